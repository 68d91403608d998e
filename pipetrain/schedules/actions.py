"""The schedule representation: per-rank ordered lists of actions.

A :class:`Schedule` is plain data. The validator, the simulator and the runtime all read the
same value, so a predicted timeline and a measured one describe the same actions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple


class Kind(str, Enum):
    """What an action does."""

    FORWARD = "F"
    BACKWARD = "B"  # input gradient (plus weight gradient when the backward is not split)
    WEIGHT = "W"  # weight gradient, only in schedules that split the backward
    SEND_F = "SEND_F"  # send a forward activation to the next stage
    RECV_F = "RECV_F"  # receive a forward activation from the previous stage
    SEND_B = "SEND_B"  # send an input gradient to the previous stage
    RECV_B = "RECV_B"  # receive an output gradient from the next stage
    ALLREDUCE = "ALLREDUCE"  # all-reduce a replicated stage's weight gradients
    STEP = "STEP"  # apply the optimizer to one stage's weights

    # hash as the plain string, in C: schedules key large dicts by kinds
    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value


COMPUTE_KINDS = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT})
SEND_KINDS = frozenset({Kind.SEND_F, Kind.SEND_B})
RECV_KINDS = frozenset({Kind.RECV_F, Kind.RECV_B})


class Action(NamedTuple):
    """One step of one rank's work.

    ``stage`` is the model stage the action belongs to. ``microbatch`` is the micro-batch
    (or, in asynchronous schedules, the mini-batch) it works on; ``None`` for ``STEP`` and
    ``ALLREDUCE``. ``peer`` is the other rank of a send or receive. ``version`` is the
    weight version a ``F``/``B``/``W`` must use (asynchronous schedules) or the version a
    ``STEP`` produces; ``None`` means "the current weights".
    """

    kind: Kind
    stage: int
    microbatch: int | None = None
    peer: int | None = None
    version: int | None = None

    def __str__(self) -> str:
        text = f"{self.kind.value}{self.stage}"
        if self.microbatch is not None:
            text += f".{self.microbatch}"
        if self.peer is not None:
            text += f"@{self.peer}"
        if self.version is not None:
            text += f"v{self.version}"
        return text


@dataclass(frozen=True)
class Schedule:
    """Every rank's ordered actions for one training step (or one window of async steps).

    ``stage_ranks[s]`` lists the ranks that hold stage ``s``; a stage on more than one rank
    is replicated and micro-batch ``k`` of it runs on ``stage_ranks[s][k % replicas]``.
    """

    name: str
    stages: int
    microbatches: int
    ranks: tuple[tuple[Action, ...], ...]
    stage_ranks: tuple[tuple[int, ...], ...]
    split_backward: bool = False
    asynchronous: bool = False
    options: dict = field(default_factory=dict, compare=False)

    @property
    def num_ranks(self) -> int:
        """How many ranks (worker processes) the schedule needs."""
        return len(self.ranks)

    def rank_of(self, stage: int, microbatch: int) -> int:
        """The rank that runs ``microbatch`` of ``stage`` (round-robin over replicas)."""
        replicas = self.stage_ranks[stage]
        return replicas[microbatch % len(replicas)]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages a rank holds, in increasing order."""
        return tuple(s for s, ranks in enumerate(self.stage_ranks) if rank in ranks)

    def compute_order(self, rank: int) -> list[str]:
        """The rank's compute actions as short strings, for reading and tests."""
        return [str(a) for a in self.ranks[rank] if a.kind in COMPUTE_KINDS]

    def describe(self) -> str:
        """A readable listing of every rank's compute actions."""
        lines = [f"{self.name}: {self.stages} stages, {self.microbatches} micro-batches"]
        for rank in range(self.num_ranks):
            lines.append(f"  rank {rank}: " + " ".join(self.compute_order(rank)))
        return "\n".join(lines)
