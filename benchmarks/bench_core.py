"""Pure core speed: large schedules built, validated and simulated, and plans chosen.

(a) ``1f1b`` at several sizes (ranks × micro-batches): the seconds to build it (generate,
lower, validate) and to simulate it with forward 1 s and backward 2 s, its action count, and
the exponent ``k`` of time ∝ actions^k (a least-squares line through the log-log points).
(b) :func:`pipetrain.plan` on a synthetic profile (``bench_planner.synthetic_profile``) over a
two-level topology with replication, and on many workers of one fast level.

Each row gives the fastest of ``--rounds`` timings and, in brackets, their median, beside a
reference loop timed just before it (``sum(range(10**6))``): the machine's speed changes
from minute to minute, and the last column, time in reference loops, does not. Run from
the repository root; prints markdown tables:

    python benchmarks/bench_core.py [--sizes 64x512,128x1024,256x2048] [--rounds 5]
        [--layers 500] [--topology 8x100GB/s,8x10Gbit/s] [--workers 4096]
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np
from bench_planner import synthetic_profile

import pipetrain
from pipetrain.schedules import build

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


def schedules(sizes: list[tuple[int, int]], rounds: int) -> None:
    """Time ``1f1b`` at each size; print its rows and the fitted exponents."""
    costs = pipetrain.Costs(forward_s=1.0, backward_s=2.0)
    print(
        "| work | actions | build + validate s | simulate s | total s (median) "
        "| reference loop ms | total in reference loops |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    counts: list[int] = []
    columns: dict[str, list[float]] = {"build": [], "simulate": [], "total": []}
    for ranks, microbatches in sizes:
        reference = reference_s()
        build_s, build_median, schedule, _ = timed(
            rounds, functools.partial(build, "1f1b", ranks, microbatches)
        )
        simulate_s, simulate_median, _, _ = timed(
            rounds, functools.partial(pipetrain.simulate, schedule, costs)
        )
        actions = sum(len(lane) for lane in schedule.ranks)
        counts.append(actions)
        total = build_s + simulate_s
        for key, value in zip(columns, (build_s, simulate_s, total)):
            columns[key].append(value)
        print(
            f"| 1f1b, {ranks} ranks × {microbatches} micro-batches | {actions:,} | "
            f"{build_s:.3f} | {simulate_s:.3f} | "
            f"{total:.3f} ({build_median + simulate_median:.3f}) "
            f"| {reference * 1e3:.1f} | {total / reference:.0f} |"
        )
        del schedule
        gc.collect()
    if len(counts) > 1:
        fitted = " | ".join(f"{exponent(counts, columns[key]):.2f}" for key in columns)
        print(f"| exponent k, time ∝ actions^k | | {fitted} | | |")


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
    """Time the schedule sizes and the plans; print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=sizes, default=sizes("64x512,128x1024,256x2048"))
    parser.add_argument(
        "--rounds", type=int, default=5, help="timings per row (the fastest, and the median)"
    )
    parser.add_argument("--layers", type=int, default=500)
    parser.add_argument("--topology", default="8x100GB/s,8x10Gbit/s")
    parser.add_argument("--workers", type=int, default=4096)
    args = parser.parse_args()
    if args.rounds < 1 or args.layers < 1 or args.workers < 1:
        parser.error("--rounds, --layers and --workers must be at least 1")
    schedules(args.sizes, args.rounds)
    gc.collect()  # the large schedules are gone: the planner's collections should not walk them
    print()
    plans(args.layers, args.topology, args.workers, args.rounds)


if __name__ == "__main__":
    main()
