"""The links between the workers of a process group, measured: bandwidth and latency.

The planner needs them to know what a message and an all-reduce cost on the real network
(``train --plan auto`` plans for the topology measured here). Each rank times messages to
the next rank of the ring: a small one gives the latency, a large one the bandwidth.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

SMALL_BYTES = 4
LARGE_BYTES = 4_000_000
"""Large enough that its bytes, not the per-message cost, set its time on a 100 Mbit/s link
(0.32 s there), small enough to cost milliseconds on a fast one."""


class Link(NamedTuple):
    """A link's bandwidth (bytes/s) and the time one message takes besides its bytes."""

    bandwidth: float
    latency_s: float


def measure_links(rounds: int = 3) -> Link:
    """Call on every rank of the default process group (gloo, CPU tensors): the slowest
    bandwidth and the largest latency measured between ring neighbours (rank ``r`` and
    ``r + 1``, all pairs in turn), the same on every rank.

    A message's time is the median of ``rounds`` round trips (the message there, one byte
    back), halved for the latency; bandwidth is the large message's extra bytes over its
    extra time (:func:`bandwidth_of`). With one rank there is no link: infinite bandwidth,
    no latency.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return Link(math.inf, 0.0)
    # the links this rank sent over: -bandwidth and latency, so that MAX finds the slowest
    measured = torch.tensor([-math.inf, 0.0], dtype=torch.float64)
    # even senders first, then odd ones, so that no rank is in two pairs at once
    for parity in (0, 1) if world > 2 else (0,):
        for sender in range(parity, world, 2):
            receiver = (sender + 1) % world
            if world % 2 == 1 and parity == 0 and sender == world - 1:
                continue  # an odd ring's last link: measured alone below
            if rank in (sender, receiver):
                _measure_pair(sender, receiver, rank, rounds, measured)
        dist.barrier()
    if world % 2 == 1 and world > 2:
        if rank in (world - 1, 0):
            _measure_pair(world - 1, 0, rank, rounds, measured)
        dist.barrier()
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    return Link(-float(measured[0]), float(measured[1]))


def _measure_pair(sender: int, receiver: int, rank: int, rounds: int, out: torch.Tensor) -> None:
    """Time the link from ``sender`` to ``receiver``; the sender writes it into ``out``."""
    times = []
    for size in (SMALL_BYTES, LARGE_BYTES):
        payload = torch.zeros(size, dtype=torch.uint8)
        reply = torch.zeros(1, dtype=torch.uint8)
        runs = []
        for _ in range(rounds + 1):  # the first round sets the connection up
            start = time.perf_counter()
            if rank == sender:
                dist.send(payload, receiver)
                dist.recv(reply, receiver)
            else:
                dist.recv(payload, sender)
                dist.send(reply, sender)
            runs.append(time.perf_counter() - start)
        times.append(statistics.median(runs[1:]))
    if rank == sender:
        small, large = times
        out[0] = max(float(out[0]), -bandwidth_of(small, large))
        out[1] = max(float(out[1]), small / 2)


def bandwidth_of(small_s: float, large_s: float) -> float:
    """Bytes/s from the round trips of the small and the large message: the large one's
    extra bytes over its extra time, that time taken as at least half its round trip. On a
    fast link the two round trips are close, and a moment's delay of the small one (another
    process on the core) can make their difference vanish or turn negative: the bound
    keeps such a link fast but finite."""
    return (LARGE_BYTES - SMALL_BYTES) / max(large_s - small_s, large_s / 2)
