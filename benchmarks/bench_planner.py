"""Time the planner on a large problem: 500 layers, 64 workers over two network levels.

Run from the repository root: ``python benchmarks/bench_planner.py``. Prints the time of
the replication planner alone and of the whole :func:`pipetrain.planning.plan` (which also
simulates candidate schedules) in a new process, as ``pipetrain plan`` runs it, and the
chosen plan; each beside a reference loop (``sum(range(10**6))``, the fastest of 5 timed
just before), since this machine's speed changes from minute to minute. The target is
under 1 s for the whole plan.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from pipetrain.planning import Topology, plan, replicate
from pipetrain.profiler import LayerCost, Profile, Spread


def synthetic_profile(layers: int, seed: int = 0) -> Profile:
    """A transformer-like profile: uneven compute, weights and activations per layer."""
    rng = np.random.default_rng(seed)
    compute = rng.uniform(1e-3, 1e-2, layers)
    return Profile(
        [
            LayerCost(
                forward_s=float(c / 3),
                backward_s=float(2 * c / 3),
                activation_bytes=float(a),
                parameter_bytes=float(w),
                optimizer_bytes=float(2 * w),
                name=f"layer{index}",
            )
            for index, (c, a, w) in enumerate(
                zip(compute, rng.uniform(1e5, 1e7, layers), rng.uniform(0, 4e7, layers))
            )
        ],
        microbatch_size=8,
        input_bytes=1e6,
    )


def main() -> None:
    """Plan once and print the timings."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=500)
    parser.add_argument("--topology", default="8x16GB/s,8x10Gbit/s")
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument(
        "--schedules",
        help="comma-separated families to plan over (default: the planner's own default)",
    )
    args = parser.parse_args()
    schedules = args.schedules.split(",") if args.schedules else None
    profile = synthetic_profile(args.layers)
    topology = Topology.parse(args.topology)

    reference = min(_seconds(lambda: sum(range(10**6))) for _ in range(5))
    start = time.perf_counter()
    replication = replicate(
        [layer.compute_s for layer in profile.layers],
        [layer.parameter_bytes for layer in profile.layers],
        [layer.activation_bytes for layer in profile.layers],
        topology,
    )
    replicate_s = time.perf_counter() - start

    start = time.perf_counter()
    chosen = plan(
        profile,
        topology=topology,
        batch_size=args.batch_size,
        memory_limit=80e9,
        schedules=schedules,
    )
    plan_s = time.perf_counter() - start

    rng = np.random.default_rng(1)
    runs = [[float(f) for f in rng.lognormal(0.0, 0.2, args.layers)] for _ in range(50)]
    measured = replace(
        profile,
        spread=Spread(
            [[layer.forward_s * f for layer, f in zip(profile.layers, run)] for run in runs],
            [[layer.backward_s * f for layer, f in zip(profile.layers, run)] for run in runs],
        ),
    )
    start = time.perf_counter()
    varied = plan(
        measured,
        topology=topology,
        batch_size=args.batch_size,
        memory_limit=80e9,
        schedules=schedules,
    )
    varied_s = time.perf_counter() - start

    print(f"{args.layers} layers on {topology} ({topology.workers} workers)")
    print(f"replication planner: {replicate_s:.3f} s, {len(replication.stages)} stages")
    print(
        f"whole plan (layouts, memory, simulation): {plan_s:.3f} s (target < 1 s); "
        f"reference loop {reference * 1e3:.1f} ms: {plan_s / reference:.0f} loops"
    )
    print("\n".join(chosen.describe().splitlines()[:2]))
    print(f"layers per stage {chosen.balance}, replicas {chosen.replicas}")
    print(
        f"with 50 measured runs per layer (steps simulated with variation): {varied_s:.3f} s, "
        f"predicted step {varied.predicted_step_s:.4g} s against "
        f"{varied.steady_step_s:.4g} s steady"
    )


def _seconds(work: Callable[[], object]) -> float:
    """How long ``work()`` took."""
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
