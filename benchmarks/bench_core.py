"""Pure core speed: every schedule family built, validated and simulated at scale, and plans.

(a) Each registered schedule family at ``--size`` (ranks × micro-batches, default 64 × 512):
the seconds to build it (generate, lower, validate) and to simulate it with forward 1 s and
backward 2 s, its action count, and its first build (which pays for any order search its
family caches, for ``zb-v``, ``v-half``, ``v-min``, ``interleaved-zb`` and ``dualpipev``).
Then each family again at ``--exponent-sizes`` (fastest of ``--exponent-rounds``, the first
of which is the cold build), and the exponent ``k`` of time ∝ actions^k over the three
sizes (a least-squares line through the log-log points).
(b) :func:`pipetrain.plan` on a synthetic profile (``bench_planner.synthetic_profile``) over a
two-level topology with replication, and on many workers of one fast level.

Each row gives the fastest of ``--rounds`` timings and, in brackets, their median, beside a
reference loop timed just before it (``sum(range(10**6))``): the machine's speed changes
from minute to minute, and the last column, time in reference loops, does not. Freeing a
round's schedule and timeline is not timed. Run from the repository root; prints markdown
tables:

    python benchmarks/bench_core.py [--size 64x512] [--rounds 5]
        [--exponent-sizes 32x256,128x1024] [--exponent-rounds 2] [--families 1f1b,zb-v]
        [--layers 500] [--topology 8x100GB/s,8x10Gbit/s] [--workers 4096]
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import numpy as np
from bench_planner import synthetic_profile

import pipetrain
from pipetrain.schedules import build, names

T = TypeVar("T")


def timed(rounds: int, work: Callable[[], T]) -> tuple[float, float, T, float]:
    """The fastest and the median of ``rounds`` timings of ``work()``, its last result, and
    the first timing (which pays for what later rounds find cached)."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        result = work()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times), result, times[0]


def reference_s() -> float:
    """The fastest of 5 timings of ``sum(range(10**6))``: how fast this machine runs Python
    right now (a shared virtual machine's speed can change by half within minutes)."""
    return timed(5, lambda: sum(range(10**6)))[0]


def sizes(text: str) -> list[tuple[int, int]]:
    """``"64x512,128x1024"`` -> ``[(64, 512), (128, 1024)]`` (an argparse ``type``)."""
    try:
        pairs = [tuple(int(part) for part in size.split("x")) for size in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RANKSxMICROBATCHES,..., got {text!r}") from None
    if any(len(pair) != 2 or min(pair) < 1 for pair in pairs):
        raise argparse.ArgumentTypeError(f"expected RANKSxMICROBATCHES,..., got {text!r}")
    return [(pair[0], pair[1]) for pair in pairs]


def exponent(actions: list[int], seconds: list[float]) -> float:
    """The slope of log(seconds) against log(actions), by least squares."""
    return float(np.polyfit(np.log(actions), np.log(seconds), 1)[0])


class Timing(NamedTuple):
    """One family at one size: its actions, the first build's seconds, the fastest build
    and simulation, the median build plus simulation, and the reference loop before."""

    actions: int
    first_s: float
    build_s: float
    simulate_s: float
    median_s: float
    reference_s: float

    @property
    def total_s(self) -> float:
        """The fastest build plus the fastest simulation."""
        return self.build_s + self.simulate_s


def measure(name: str, ranks: int, microbatches: int, rounds: int) -> Timing:
    """Build and simulate ``name`` ``rounds`` times; the first build is the cold one."""
    costs = pipetrain.Costs(forward_s=1.0, backward_s=2.0)
    reference = reference_s()
    builds, simulations = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        schedule = build(name, ranks, microbatches)
        built = time.perf_counter()
        timeline = pipetrain.simulate(schedule, costs)
        builds.append(built - start)
        simulations.append(time.perf_counter() - built)
        actions = sum(len(lane) for lane in schedule.ranks)
        del schedule, timeline
    gc.collect()
    totals = [b + s for b, s in zip(builds, simulations)]
    return Timing(
        actions,
        builds[0],
        min(builds),
        min(simulations),
        statistics.median(totals),
        reference,
    )


def schedules(
    families: list[str],
    size: tuple[int, int],
    rounds: int,
    exponent_sizes: list[tuple[int, int]],
    exponent_rounds: int,
) -> None:
    """Time every family at ``size``, then at ``exponent_sizes``; print both tables."""
    ranks, microbatches = size
    print(f"Every family at {ranks} ranks × {microbatches} micro-batches:\n")
    print(
        "| family | actions | first build s | build + validate s | simulate s "
        "| total s (median) | reference loop ms | total in reference loops |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    at_size: dict[str, Timing] = {}
    for name in families:
        timing = at_size[name] = measure(name, ranks, microbatches, rounds)
        print(
            f"| {name} | {timing.actions:,} | {timing.first_s:.2f} | {timing.build_s:.3f} "
            f"| {timing.simulate_s:.3f} | {timing.total_s:.3f} ({timing.median_s:.3f}) "
            f"| {timing.reference_s * 1e3:.1f} | {timing.total_s / timing.reference_s:.0f} |"
        )
    if not exponent_sizes:
        return
    every = sorted([size, *exponent_sizes], key=lambda pair: pair[0] * pair[1])
    labels = " | ".join(f"{r} × {m} s" for r, m in every)
    print(f"\nThe exponent k of time ∝ actions^k over {len(every)} sizes:\n")
    print(f"| family | {labels} | actions | k build | k simulate | k total |")
    print(f"|---|{'---:|' * len(every)}---:|---:|---:|---:|")
    for name in families:
        timings = [
            at_size[name] if pair == size else measure(name, *pair, exponent_rounds)
            for pair in every
        ]
        counts = [timing.actions for timing in timings]
        fitted = [
            exponent(counts, [getattr(timing, field) for timing in timings])
            for field in ("build_s", "simulate_s", "total_s")
        ]
        print(
            f"| {name} | {' | '.join(f'{timing.total_s:.3f}' for timing in timings)} "
            f"| {counts[0]:,} to {counts[-1]:,} | {' | '.join(f'{k:.2f}' for k in fitted)} |"
        )


def plans(layers: int, topology: str, workers: int, rounds: int) -> None:
    """Time the two plans; print their rows. A plan's first round also finds the schedules'
    orders at unit costs, which the process then keeps: the "first" column is what a
    `pipetrain plan` command pays, the fastest what planning again in one process does."""
    profile = synthetic_profile(layers)
    print(
        "| plan | seconds (median) | first s | reference loop ms | fastest in reference loops "
        "| first in reference loops | chosen |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for label, options in (
        (f"{layers} layers on {topology}, replication", {"topology": topology}),
        (f"{layers} layers on {workers} workers", {"workers": workers}),
    ):
        reference = reference_s()
        seconds, median, chosen, first = timed(
            rounds, functools.partial(pipetrain.plan, profile, **options)
        )
        print(
            f"| {label} | {seconds:.3f} ({median:.3f}) | {first:.3f} | {reference * 1e3:.1f} | "
            f"{seconds / reference:.0f} | {first / reference:.0f} | "
            f"{chosen.describe().splitlines()[0]} |"
        )


def main() -> None:
    """Time the schedule families and the plans; print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=sizes, default=sizes("64x512"))
    parser.add_argument(
        "--rounds", type=int, default=5, help="timings per row (the fastest, and the median)"
    )
    parser.add_argument("--exponent-sizes", type=sizes, default=sizes("32x256,128x1024"))
    parser.add_argument("--exponent-rounds", type=int, default=2)
    parser.add_argument("--families", default=",".join(names()), help="comma-separated")
    parser.add_argument("--layers", type=int, default=500)
    parser.add_argument("--topology", default="8x100GB/s,8x10Gbit/s")
    parser.add_argument("--workers", type=int, default=4096)
    args = parser.parse_args()
    if min(args.rounds, args.exponent_rounds, args.layers, args.workers) < 1:
        parser.error("--rounds, --exponent-rounds, --layers and --workers must be at least 1")
    if len(args.size) != 1:
        parser.error("--size takes one RANKSxMICROBATCHES")
    families = args.families.split(",")
    unknown = sorted(set(families) - set(names()))
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {', '.join(names())}")
    schedules(families, args.size[0], args.rounds, args.exponent_sizes, args.exponent_rounds)
    gc.collect()  # the large schedules are gone: the planner's collections should not walk them
    print()
    plans(args.layers, args.topology, args.workers, args.rounds)


if __name__ == "__main__":
    main()
