"""What a schedule is made of: the :class:`Action` (one step of one rank's work) and its
:class:`Kind`, with the text form ``F3.5``."""

from __future__ import annotations

import re
from collections.abc import Callable
from enum import Enum
from functools import lru_cache, partial
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
    SEND_T = "SEND_T"  # send the step's targets from the input stage to the last stage
    RECV_T = "RECV_T"  # receive the step's targets on the last stage
    SEND_O = "SEND_O"  # send a last-stage output to the rank that gathers them (evaluation)
    RECV_O = "RECV_O"  # receive a last-stage output from a replica (evaluation)
    ALLREDUCE = "ALLREDUCE"  # all-reduce a replicated stage's weight gradients
    GATHER = "GATHER"  # all-gather a sharded stage's parameters before the step's passes
    LOAD = "LOAD"  # fetch a stage's weights from the host store: resident until its OFFLOAD
    OFFLOAD = "OFFLOAD"  # return a stage's weight gradients to the host store and free it
    STEP = "STEP"  # apply the optimizer to one stage's weights
    LOSS = "LOSS"  # all-reduce the step's loss over every rank (ends a training step)
    OVERLAP = "OVERLAP"  # the rank's next forward and backward run together (DualPipeV)

    # hash as the plain string, in C: schedules key large dicts by kinds
    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value


COMPUTE_KINDS = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT})
SEND_KINDS = frozenset({Kind.SEND_F, Kind.SEND_B, Kind.SEND_T, Kind.SEND_O})
RECV_KINDS = frozenset({Kind.RECV_F, Kind.RECV_B, Kind.RECV_T, Kind.RECV_O})
HOST_KINDS = frozenset({Kind.LOAD, Kind.OFFLOAD})
"""Transfers between a rank and the host weight store (:mod:`~pipetrain.schedules.residency`)."""
WRITTEN_KINDS = frozenset(
    {*COMPUTE_KINDS, *HOST_KINDS, Kind.ALLREDUCE, Kind.GATHER, Kind.STEP, Kind.OVERLAP}
)
"""The kinds a schedule's author writes; the lowering pass derives every other one."""

_ACTION_TEXT = re.compile(r"^([A-Z_]+?)(\d+)(?:\.(\d+))?(?:@(\d+))?(?:v(\d+))?$")


class Action(NamedTuple):
    """One step of one rank's work.

    ``stage`` is the model stage the action belongs to. ``microbatch`` is the micro-batch
    (or, in asynchronous schedules, the mini-batch) it works on; ``None`` for ``STEP``,
    ``ALLREDUCE``, ``GATHER``, ``LOAD``, ``OFFLOAD``, ``LOSS``, ``OVERLAP`` (whose stage is
    its forward's) and the targets' transfer. ``peer`` is the other rank of a send
    or receive. ``version`` is the weight version a ``F``/``B``/``W`` must use
    (asynchronous schedules) or the version a ``STEP`` produces; ``None`` means "the current
    weights". The text form is ``F3.5`` (kind, stage, micro-batch), then ``@peer`` and
    ``vversion`` where set: ``SEND_F0.2@1``, ``B1.0v2``.
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

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action written as ``text`` (the inverse of ``str``); ValueError if malformed."""
        match = _ACTION_TEXT.match(text)
        kinds = {kind.value: kind for kind in Kind}
        if match is None or match.group(1) not in kinds:
            raise ValueError(
                f"{text!r} is not an action: write kind, stage and micro-batch such as F0.3, "
                f"B1.0, W2.1, STEP0, LOAD3 or ALLREDUCE1 (kinds: {', '.join(kinds)}), then @peer "
                "and v<version> where needed"
            )
        kind, stage, microbatch, peer, version = match.groups()
        return cls(
            kinds[kind],
            int(stage),
            None if microbatch is None else int(microbatch),
            None if peer is None else int(peer),
            None if version is None else int(version),
        )


trusted_action: Callable[[tuple[Kind, int, int | None, int | None, int | None]], Action] = partial(
    tuple.__new__, Action
)
"""An :class:`Action` from a ``(kind, stage, microbatch, peer, version)`` tuple of the right
types, unchecked and made in C: how lowering and generators make actions by the hundred
thousand."""


@lru_cache(maxsize=16)
def shared_ints(count: int) -> tuple[int, ...]:
    """``0 .. count − 1``, one int object each, kept: generators number micro-batches with
    them, so every action of a micro-batch, on every rank, holds the same object (ints of
    256 and above are otherwise made afresh, and each pass over a schedule reads them)."""
    return tuple(range(count))
