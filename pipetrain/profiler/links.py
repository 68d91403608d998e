"""The links between the workers of a process group, measured: bandwidth and latency.

The planner needs them to know what a message and an all-reduce cost on the real network
(``train --plan auto`` plans for the topology measured here). Each rank times messages to
the next rank of the ring: a large one against a small one gives the bandwidth, small
ones while the other ranks compute give the latency.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist

SMALL_BYTES = 4
LARGE_BYTES = 4_000_000
"""Large enough that its bytes, not the per-message cost, set its time on a 100 Mbit/s link
(0.32 s there), small enough to cost milliseconds on a fast one."""

LATENCY_WINDOW_S = 0.06
"""How long each link is timed with small round trips for the latency while the other
ranks compute (on 4 workers, four links: a quarter of a second)."""

_BUSY_SIDE = 128  # the matrices ranks multiply to keep busy: a fraction of a ms a product


class Link(NamedTuple):
    """A link's bandwidth (bytes/s) and the time one message takes besides its bytes."""

    bandwidth: float
    latency_s: float


def measure_links(rounds: int = 3, latency_window_s: float = LATENCY_WINDOW_S) -> Link:
    """Call on every rank of the default process group (gloo, CPU tensors): the slowest
    bandwidth measured between ring neighbours (rank ``r`` and ``r + 1``, all pairs in
    turn) and the mean latency over all of them, the same on every rank.

    The bandwidth is the large message's extra bytes over its extra time, the median of
    ``rounds`` round trips (the message there, one byte back) against the median of as
    many of the small message's (:func:`bandwidth_of`). The latency is half a round trip:
    each link in turn makes small round trips for ``latency_window_s`` while every other
    rank computes, as in training, and the links' mean round trips are averaged. Where
    workers share cores, a receiver woken while the cores are busy may wait for one, and
    whether it does depends on where the scheduler has put the processes, which holds for
    tens of milliseconds at a time: on an emulated cluster's 2 cores one window's round
    trips took 0.1 ms each and the next one's 3-4 ms. Each window is one sample of that,
    weighed alike, where a mean over every round trip would let the fast placement, which
    fits thirty times as many round trips in a window, hide the slow one (messages in
    training come at the pipeline's pace, not as fast as the link turns them around). The
    flat topology the planner builds has one latency: a single slow link is averaged in,
    not singled out. With one rank there is no link: infinite bandwidth, no latency.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return Link(math.inf, 0.0)
    slowest = torch.tensor([-math.inf], dtype=torch.float64)  # -bandwidth: MAX finds it
    # even senders first, then odd ones, so that no rank is in two pairs at once
    for parity in (0, 1) if world > 2 else (0,):
        for sender in range(parity, world, 2):
            receiver = (sender + 1) % world
            if world % 2 == 1 and parity == 0 and sender == world - 1:
                continue  # an odd ring's last link: measured alone below
            if rank in (sender, receiver):
                _measure_bandwidth(sender, receiver, rank, rounds, slowest)
        dist.barrier()
    if world % 2 == 1 and world > 2:
        if rank in (world - 1, 0):
            _measure_bandwidth(world - 1, 0, rank, rounds, slowest)
        dist.barrier()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    round_trips = torch.zeros(2, dtype=torch.float64)  # the links' mean round trips, count
    for sender in range(world if world > 2 else 1):
        _time_latency_loaded(sender, (sender + 1) % world, rank, latency_window_s, round_trips)
    dist.all_reduce(round_trips)
    total, count = (float(value) for value in round_trips)
    return Link(-float(slowest[0]), total / count / 2)


def combined(measurements: Sequence[Link]) -> Link:
    """Several measurements of the same links as one: the slowest bandwidth and the mean
    latency. Round trips on shared cores can keep to one regime for seconds at a time (a
    4 ms scheduler tick, before gloo's loop threads were deferred:
    :mod:`pipetrain.distributed.io_threads`), so measurements taken apart (before and after a
    profile) sample more of them than one measurement of many round trips."""
    if not measurements:
        raise ValueError("combined() needs at least one measurement")
    return Link(
        min(link.bandwidth for link in measurements),
        statistics.fmean(link.latency_s for link in measurements),
    )


def _measure_bandwidth(
    sender: int, receiver: int, rank: int, rounds: int, slowest: torch.Tensor
) -> None:
    """Time the link from ``sender`` to ``receiver`` with ``rounds`` round trips of each
    message; the sender adds its bandwidth to ``slowest``."""
    small, large = (
        statistics.median(time_round_trips(sender, receiver, rank, size, rounds))
        for size in (SMALL_BYTES, LARGE_BYTES)
    )
    if rank == sender:
        slowest[0] = max(float(slowest[0]), -bandwidth_of(small, large))


def _time_latency_loaded(
    sender: int, receiver: int, rank: int, seconds: float, round_trips: torch.Tensor
) -> None:
    """Call on every rank: small round trips from ``sender`` to ``receiver`` for
    ``seconds`` while every other rank computes as long; the sender adds their mean and a
    count of one to ``round_trips``."""
    dist.barrier()
    deadline = time.perf_counter() + seconds
    if rank in (sender, receiver):
        runs = round_trips_until(sender, receiver, rank, deadline)
        if rank == sender:
            round_trips += torch.tensor([statistics.fmean(runs), 1.0], dtype=torch.float64)
    else:
        busy_until(partial(past, deadline))


def past(deadline: float) -> bool:
    """Whether the wall clock has passed ``deadline`` (a ``time.perf_counter`` reading)."""
    return time.perf_counter() > deadline


def busy_until(finished: Callable[[], bool]) -> None:
    """Keep this rank's core busy multiplying small matrices until ``finished()``, as a
    worker computing in training would (checked every fraction of a millisecond)."""
    matrix = torch.rand(_BUSY_SIDE, _BUSY_SIDE)
    while not finished():
        matrix = torch.mm(matrix, matrix).clamp_(0.0, 1.0)


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


def round_trips_until(sender: int, receiver: int, rank: int, deadline: float) -> list[float]:
    """Round trips of a :data:`SMALL_BYTES` message and a one-byte reply, in seconds, until
    the sender's clock passes ``deadline`` (at least one, after one that sets the
    connection up); the message's first byte tells the receiver whether another follows."""
    payload = torch.ones(SMALL_BYTES, dtype=torch.uint8)
    reply = torch.zeros(1, dtype=torch.uint8)
    runs: list[float] = []
    while True:
        if rank == sender:
            last = len(runs) > 1 and time.perf_counter() > deadline
            payload[0] = 0 if last else 1
            start = time.perf_counter()
            dist.send(payload, receiver)
            dist.recv(reply, receiver)
            runs.append(time.perf_counter() - start)
        else:
            dist.recv(payload, sender)
            dist.send(reply, sender)
            last = int(payload[0]) == 0
        if last:
            return runs[1:]


def bandwidth_of(small_s: float, large_s: float) -> float:
    """Bytes/s from the round trips of the small and the large message: the large one's
    extra bytes over its extra time, that time taken as at least half its round trip. On a
    fast link the two round trips are close, and a moment's delay of the small one (another
    process on the core) can make their difference vanish or turn negative: the bound
    keeps such a link fast but finite."""
    return (LARGE_BYTES - SMALL_BYTES) / max(large_s - small_s, large_s / 2)
