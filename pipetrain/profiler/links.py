"""The links between the workers of a process group, measured: bandwidth and latency.

The planner needs them to know what a message and an all-reduce cost on the real network
(``train --plan auto`` plans for the topology measured here). Each rank times messages to
the next rank of the ring: a small one gives the latency, a large one the bandwidth.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

SMALL_BYTES = 4
LARGE_BYTES = 4_000_000
"""Large enough that its bytes, not the per-message cost, set its time on a 100 Mbit/s link
(0.32 s there), small enough to cost milliseconds on a fast one."""

LATENCY_ROUNDS = 16
"""Small round trips timed on each link for the latency (on 4 workers, two turns of 16: under
0.15 s even at 4 ms a round trip)."""


class Link(NamedTuple):
    """A link's bandwidth (bytes/s) and the time one message takes besides its bytes."""

    bandwidth: float
    latency_s: float


def measure_links(rounds: int = 3, latency_rounds: int = LATENCY_ROUNDS) -> Link:
    """Call on every rank of the default process group (gloo, CPU tensors): the slowest
    bandwidth measured between ring neighbours (rank ``r`` and ``r + 1``, all pairs in
    turn) and the mean latency over all of them, the same on every rank.

    The bandwidth is the large message's extra bytes over its extra time, the median of
    ``rounds`` round trips (the message there, one byte back) against the median of the
    small message's (:func:`bandwidth_of`). The latency is half the mean of
    ``latency_rounds`` small round trips on every link: where workers share cores, a
    receiver woken while the cores are busy waits for one, and whether it does changes
    from moment to moment, so the mean over many round trips on every link moves less than
    a few on one (the flat topology the planner builds from it has one latency: a single
    slow link is averaged in, not singled out). With one rank there is no link: infinite
    bandwidth, no latency.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return Link(math.inf, 0.0)
    slowest = torch.tensor([-math.inf], dtype=torch.float64)  # -bandwidth: MAX finds it
    round_trips = torch.zeros(2, dtype=torch.float64)  # the small ones' total and count
    # even senders first, then odd ones, so that no rank is in two pairs at once
    for parity in (0, 1) if world > 2 else (0,):
        for sender in range(parity, world, 2):
            receiver = (sender + 1) % world
            if world % 2 == 1 and parity == 0 and sender == world - 1:
                continue  # an odd ring's last link: measured alone below
            if rank in (sender, receiver):
                _measure_pair(sender, receiver, rank, rounds, latency_rounds, slowest, round_trips)
        dist.barrier()
    if world % 2 == 1 and world > 2:
        if rank in (world - 1, 0):
            _measure_pair(world - 1, 0, rank, rounds, latency_rounds, slowest, round_trips)
        dist.barrier()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.all_reduce(round_trips)
    total, count = (float(value) for value in round_trips)
    return Link(-float(slowest[0]), total / count / 2)


def combined(measurements: Sequence[Link]) -> Link:
    """Several measurements of the same links as one: the slowest bandwidth and the mean
    latency. Round trips on shared cores can keep to one regime for seconds at a time (a
    4 ms scheduler tick, before gloo's loop threads were deferred:
    :mod:`pipetrain.runtime.io_threads`), so measurements taken apart (before and after a
    profile) sample more of them than one measurement of many round trips."""
    if not measurements:
        raise ValueError("combined() needs at least one measurement")
    return Link(
        min(link.bandwidth for link in measurements),
        statistics.fmean(link.latency_s for link in measurements),
    )


def _measure_pair(
    sender: int,
    receiver: int,
    rank: int,
    large_rounds: int,
    small_rounds: int,
    slowest: torch.Tensor,
    round_trips: torch.Tensor,
) -> None:
    """Time the link from ``sender`` to ``receiver`` with that many round trips of each
    message; the sender adds its bandwidth to ``slowest`` and its small round trips to
    ``round_trips``."""
    runs = {
        size: time_round_trips(sender, receiver, rank, size, count)
        for size, count in ((SMALL_BYTES, small_rounds), (LARGE_BYTES, large_rounds))
    }
    if rank == sender:
        small = statistics.median(runs[SMALL_BYTES])
        large = statistics.median(runs[LARGE_BYTES])
        slowest[0] = max(float(slowest[0]), -bandwidth_of(small, large))
        round_trips += torch.tensor(
            [sum(runs[SMALL_BYTES]), len(runs[SMALL_BYTES])], dtype=torch.float64
        )


def time_round_trips(sender: int, receiver: int, rank: int, size: int, count: int) -> list[float]:
    """``count`` round trips of a ``size``-byte message and a one-byte reply, in seconds,
    after one that sets the connection up."""
    payload = torch.zeros(size, dtype=torch.uint8)
    reply = torch.zeros(1, dtype=torch.uint8)
    runs = []
    for _ in range(count + 1):
        start = time.perf_counter()
        if rank == sender:
            dist.send(payload, receiver)
            dist.recv(reply, receiver)
        else:
            dist.recv(payload, sender)
            dist.send(reply, sender)
        runs.append(time.perf_counter() - start)
    return runs[1:]


def bandwidth_of(small_s: float, large_s: float) -> float:
    """Bytes/s from the round trips of the small and the large message: the large one's
    extra bytes over its extra time, that time taken as at least half its round trip. On a
    fast link the two round trips are close, and a moment's delay of the small one (another
    process on the core) can make their difference vanish or turn negative: the bound
    keeps such a link fast but finite."""
    return (LARGE_BYTES - SMALL_BYTES) / max(large_s - small_s, large_s / 2)
