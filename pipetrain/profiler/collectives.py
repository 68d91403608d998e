"""What the workers' collectives cost, measured: the all-reduce of a replicated stage's
gradients, and a sharded stage's all-gather of its weights and reduce-scatter of its
gradients.

A link's bandwidth alone prices them low on CPU workers: the backend copies and reduces
every byte on the cores as well (on a 2-core machine, gloo over two ranks took 10 ms to
all-gather 13 MB and 16 ms to reduce-scatter them, where the link carried them in 5 ms), and
its reduce-scatter costs about as much as an all-reduce. :func:`measure_collectives` times
each collective at two sizes on the training processes' own group; the planner charges a
stage's collectives the larger of that and what its links give
(:meth:`pipetrain.planning.candidates.Candidate.costs`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from pipetrain.checks import non_negative_number, positive_int

SIZES = (1 << 20, 8 << 20)
"""Bytes each collective is timed at: the extra time of the larger over the smaller gives
the cost a byte, which then holds apart from what one call costs."""


@dataclass(frozen=True)
class Collectives:
    """Per byte of a stage's weights (or gradients), what each collective took over
    ``ranks`` workers, and what one call costs besides its bytes (``fixed_s``).

    A ring moves ``(r − 1) / r`` of the bytes through each of ``r`` members, so over ``r``
    replicas each cost a byte is scaled by that fraction against the measured one's.
    """

    ranks: int
    allreduce_byte_s: float
    gather_byte_s: float
    reduce_scatter_byte_s: float
    fixed_s: float

    def __post_init__(self) -> None:
        """Reject a group under 2 ranks and negative costs, naming the field."""
        positive_int("Collectives.ranks", self.ranks)
        if self.ranks < 2:
            raise ValueError(f"Collectives.ranks = {self.ranks}: a collective needs 2 ranks")
        for name in ("allreduce_byte_s", "gather_byte_s", "reduce_scatter_byte_s", "fixed_s"):
            non_negative_number(f"Collectives.{name}", getattr(self, name))

    def seconds(self, kind: str, size_bytes: float, replicas: int) -> float:
        """What collective ``kind`` (``"allreduce"``, ``"gather"`` or ``"reduce_scatter"``)
        of ``size_bytes`` bytes over ``replicas`` ranks takes (0 for one rank)."""
        if replicas < 2:
            return 0.0
        per_byte: float = getattr(self, f"{kind}_byte_s")
        ring = (replicas - 1) / replicas / ((self.ranks - 1) / self.ranks)
        return self.fixed_s + per_byte * size_bytes * ring

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary (:meth:`from_dict` reads it)."""
        return {
            "ranks": self.ranks,
            "allreduce_byte_s": self.allreduce_byte_s,
            "gather_byte_s": self.gather_byte_s,
            "reduce_scatter_byte_s": self.reduce_scatter_byte_s,
            "fixed_s": self.fixed_s,
        }

    @classmethod
    def from_dict(cls, data: object) -> Collectives:
        """The costs :meth:`to_dict` wrote; ValueError naming what is missing or unknown."""
        expected = {"ranks", "allreduce_byte_s", "gather_byte_s", "reduce_scatter_byte_s"}
        if not isinstance(data, dict) or not expected <= set(data) <= expected | {"fixed_s"}:
            raise ValueError(
                f"a profile's collectives must be an object with {sorted(expected)} and "
                f"fixed_s, got {data!r}"
            )
        return cls(**data)


def measure_collectives(rounds: int = 5) -> Collectives | None:
    """Call on every rank of the default process group (gloo, CPU tensors): time an
    all-reduce, an all-gather and a reduce-scatter of each of :data:`SIZES` bytes over the
    whole group, ``rounds`` times each after a barrier, and return the same costs on every
    rank (the slowest rank's medians); ``None`` with one rank."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    if world < 2:
        return None
    medians: dict[str, list[float]] = {"allreduce": [], "gather": [], "reduce_scatter": []}
    for size in SIZES:
        count = size // 4 // world * world  # float32 elements, a whole shard each
        whole, shard = torch.ones(count), torch.ones(count // world)
        calls: dict[str, Callable[[], object]] = {
            "allreduce": partial(dist.all_reduce, whole),
            "gather": partial(dist.all_gather_into_tensor, whole, shard),
            "reduce_scatter": partial(dist.reduce_scatter_tensor, shard, whole),
        }
        for kind, call in calls.items():
            call()  # the first call sets the backend's buffers up
            times = []
            for _ in range(rounds):
                dist.barrier()
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            medians[kind].append(statistics.median(times))
    # the slowest rank's medians (every rank then returns the same)
    flat = torch.tensor([t for kind in medians for t in medians[kind]], dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    small, large = SIZES
    per_byte, fixed = {}, []
    for index, kind in enumerate(medians):
        at_small, at_large = flat[2 * index].item(), flat[2 * index + 1].item()
        slope = max(at_large - at_small, 0.0) / (large - small)
        per_byte[kind] = slope
        fixed.append(max(at_small - slope * small, 0.0))
    return Collectives(
        world,
        per_byte["allreduce"],
        per_byte["gather"],
        per_byte["reduce_scatter"],
        statistics.median(fixed),
    )
