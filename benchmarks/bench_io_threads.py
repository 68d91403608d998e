"""What gloo's event-loop threads cost small messages when they may take a core on wakeup.

Four worker processes (1 thread each) on this machine make two pairs, (0, 1) and (2, 3),
and each pair makes round trips of a 4-byte message and a 1-byte reply with gloo's
blocking send and receive (as the plan jobs' link measurement does), both pairs at once.
Every round runs both ways in turn in the same processes, so both see the same machine:

- ``normal``: gloo's ``gloo_tcp_loop`` threads under the default policy (the baseline);
- ``deferred``: the same threads marked ``SCHED_BATCH``, as pipetrain marks them
  (:func:`pipetrain.distributed.io_threads.defer_gloo_io_threads`).

It prints, for each, the median, mean and 90th percentile of a round trip and the share
that took over 2 ms, over both pairs and every round, and the means' ratio.

    python benchmarks/bench_io_threads.py [--trips 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch.distributed as dist

import pipetrain
from pipetrain.distributed.io_threads import defer_gloo_io_threads, loop_threads
from pipetrain.profiler.links import SMALL_BYTES, time_round_trips

WARMUP = 20
ARMS = ("normal", "deferred")


def _undo_deferral() -> None:
    """Put this process's gloo event-loop threads back under the default policy."""
    for thread in loop_threads():
        os.sched_setscheduler(thread, os.SCHED_OTHER, os.sched_param(0))


def _pair_round_trips(trips: int) -> list[float]:
    """Seconds of each round trip this rank's pair made (the pair's first rank times them)."""
    rank = dist.get_rank()
    sender = rank - rank % 2
    times = time_round_trips(sender, sender + 1, rank, SMALL_BYTES, WARMUP + trips)[WARMUP:]
    return times if rank == sender else []


def worker(trips: int, rounds: int) -> dict[str, list[float]] | None:
    """Worker: both arms in turn, ``rounds`` times; rank 0 returns every pair's round trips."""
    collected: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for _ in range(rounds):
        for arm in ARMS:
            if arm == "normal":
                _undo_deferral()
            else:
                defer_gloo_io_threads()
            dist.barrier()
            gathered: list[list[float]] = [[] for _ in range(dist.get_world_size())]
            dist.all_gather_object(gathered, _pair_round_trips(trips))
            for times in gathered:
                collected[arm] += times
    return collected if dist.get_rank() == 0 else None


def main() -> None:
    """Run the benchmark and print its table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trips", type=int, default=300, help="round trips a pair makes per arm")
    parser.add_argument("--rounds", type=int, default=3, help="times each arm runs, in turn")
    args = parser.parse_args()
    collected = pipetrain.launch(worker, 4, args.trips, args.rounds, threads_per_worker=1)[0]
    print(f"2 pairs of processes on {os.cpu_count()} cores, {args.rounds} rounds of {args.trips}")
    print(f"{'threads':10} {'median ms':>10} {'mean ms':>8} {'p90 ms':>7} {'over 2 ms':>10}")
    means = {}
    for arm in ARMS:
        times = sorted(collected[arm])
        means[arm] = statistics.mean(times)
        slow = sum(t > 2e-3 for t in times) / len(times)
        print(
            f"{arm:10} {statistics.median(times) * 1e3:10.3f} {means[arm] * 1e3:8.3f} "
            f"{times[int(0.9 * len(times))] * 1e3:7.3f} {slow:10.1%}"
        )
    print(f"mean round trip, deferred over normal: {means['deferred'] / means['normal']:.2f}")


if __name__ == "__main__":
    main()
