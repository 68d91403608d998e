"""Workers that share one machine's cores: how many of them the cores run at once, and how
much more core time their work takes when they are more than that.

Local workers, and an emulated cluster's hosts, are processes on one machine. The planner
models their sharing (:mod:`pipetrain.planning.sharing`) from a profile taken with a core
to each worker, and that profile misses a cost of sharing itself: a process that gets a
core back after another ran there finds its caches refilled with the other's data, and
switching between them takes the kernel's time. Four VGG workers on two cores spent
1.06-1.11 times the CPU time on the profiler's timings of its layers as two did, and in
training on an emulated cluster the workers' actions took 8% more CPU time than the
profile's. Measured as :func:`measure_shared_cores_factor` does it, in an emulated
cluster's plan jobs: 1.07-1.18.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

FACTOR_REPEATS = 16
"""Runs of the work each rank times in its turn; with every rank running, the ranks run it
for as long as the slowest rank's run alone, times this, times the ranks per core."""


def shared_cores(threads: int) -> int | None:
    """Call on every rank of the default process group: the workers (of ``threads`` threads)
    that this machine's cores can run at once, when every rank runs on this one machine and
    they are more than that (local workers, or an emulated cluster's hosts); else ``None``."""
    with open("/proc/sys/kernel/random/boot_id") as boot:
        machine = boot.read().strip() or socket.gethostname()
    machines: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(machines, machine)
    cores = max(1, len(os.sched_getaffinity(0)) // threads)
    if len(set(machines)) > 1 or cores >= dist.get_world_size():
        return None
    return cores


def slowdown_of(alone_s: float, together_s: float) -> float:
    """The factor from a run's core time alone and together (summed over the ranks):
    their ratio, at least 1, since sharing cannot make work faster (a ratio below 1 is the
    noise of the two measurements)."""
    if not (alone_s > 0 and math.isfinite(alone_s) and math.isfinite(together_s)):
        raise ValueError(f"core times alone {alone_s} and together {together_s}: need alone > 0")
    return max(1.0, together_s / alone_s)


def measure_shared_cores_factor(
    work: Callable[[], object],
    at_once: int,
    repeats: int = FACTOR_REPEATS,
    warmup: int = 2,
    clock: Callable[[], float] = time.process_time,
) -> float:
    """Call on every rank of the default process group (gloo), whose ranks share cores that
    run ``at_once`` of them: how many times the core time of a run of ``work`` (a forward
    and backward of the model) grows when every rank runs it at once over when the ranks
    take turns of ``at_once``, as they do while profiling; the same on every rank.

    In its turn each rank times ``repeats`` runs after ``warmup``. Then the ranks start
    together and run ``work`` until a common deadline, so that every run meets the others
    (a fixed count would leave the fastest rank's last runs alone). ``clock`` reads the core
    time of every thread of the process, so waiting for a core does not count. Each side is
    a rank's median run; the ranks' sums give the factor.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    alone: list[float] = []
    for turn in range(-(-world // at_once)):
        dist.barrier()
        if rank // at_once == turn:
            alone = _timed_runs(work, clock, warmup, repeats=repeats)
    medians = torch.tensor([statistics.median(alone), 0.0], dtype=torch.float64)
    longest = medians[:1].clone()
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    dist.barrier()
    deadline = time.perf_counter() + float(longest[0]) * repeats * world / at_once
    medians[1] = statistics.median(_timed_runs(work, clock, 0, deadline=deadline))
    dist.all_reduce(medians)
    return slowdown_of(*medians.tolist())


def _timed_runs(
    work: Callable[[], object],
    clock: Callable[[], float],
    warmup: int,
    repeats: int = 0,
    deadline: float = -math.inf,
) -> list[float]:
    """Each run's ``clock`` time: ``warmup`` untimed runs, then at least ``repeats`` and
    one, and more until the wall clock passes ``deadline``."""
    for _ in range(warmup):
        work()
    runs: list[float] = []
    while len(runs) < max(repeats, 1) or time.perf_counter() < deadline:
        start = clock()
        work()
        runs.append(clock() - start)
    return runs
