"""How long building, validating and simulating a large schedule takes.

For each registered schedule, 64 ranks × 512 micro-batches (interleaved: 2 chunks per rank;
2bw: 512 micro-batches per update, 2 updates): the time to build (generate, lower, validate)
and the time to simulate, each the best of 3 runs.

    python benchmarks/bench_simulate.py [--stages 64] [--microbatches 512]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import TypeVar

from pipetrain.schedules import build, names, spec
from pipetrain.simulation import Costs, simulate

T = TypeVar("T")


def best_of(runs: int, work: Callable[[], T]) -> tuple[float, T]:
    """The fastest of ``runs`` timings of ``work()`` and its last result (``runs`` >= 1)."""
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        result = work()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    """Time every schedule and print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=512)
    args = parser.parse_args()
    costs = Costs(
        forward_s=1.0,
        backward_s=1.0,
        weight_s=1.0,
        activation_bytes=1e6,
        bandwidth=1e9,
        latency_s=1e-5,
    )
    print(f"{args.stages} stages x {args.microbatches} micro-batches")
    print(f"{'schedule':12} {'actions':>9} {'build s':>8} {'simulate s':>11} {'bubble':>8}")
    for name in names():
        build_s, schedule = best_of(
            3, functools.partial(build, name, args.stages, args.microbatches)
        )
        chunks = spec(name).chunks({})
        per_chunk = Costs(
            **{
                **costs.__dict__,
                "forward_s": 1 / chunks,
                "backward_s": 1 / chunks,
                "weight_s": 1 / chunks,
            }
        )
        simulate_s, timeline = best_of(3, functools.partial(simulate, schedule, per_chunk))
        actions = sum(len(actions) for actions in schedule.ranks)
        print(
            f"{name:12} {actions:9d} {build_s:8.2f} {simulate_s:11.2f} "
            f"{timeline.bubble_fraction:8.3f}"
        )


if __name__ == "__main__":
    main()
