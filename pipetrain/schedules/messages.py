"""What every send and receive carries: the one statement of message semantics.

The lowering pass, the validator, the simulator and the runtime's executor all read these
rules, so they cannot drift apart.

====================  ==================  =========================  ==================
action                carries             channel                    matched receive
====================  ==================  =========================  ==================
``SEND_F s.k``        outputs of F s.k    ``("F", s)``               ``RECV_F s+1.k``
``SEND_B s.k``        input grads, B s.k  ``("B", s-1)``             ``RECV_B s-1.k``
``SEND_T s``          the step's targets  ``("T", 0)``               ``RECV_T last``
``SEND_O s.k``        outputs of F s.k    ``("O", 0)``               ``RECV_O s.k``
====================  ==================  =========================  ==================

A channel names a boundary between stages (``("F", b)`` and ``("B", b)`` cross boundary
``b``, between stage ``b`` and ``b + 1``), so one pair of ranks may carry several. A send
and the receive it matches have the same :func:`message` key. Micro-batch ``k`` of stage
``s`` runs on :func:`rank_of`: round-robin over the stage's replicas.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.schedules.actions import Action, Kind

Channel = tuple[str, int]
"""A transport channel: a message family and the boundary it crosses."""

MessageKey = tuple[str, int, int | None]
"""``(family, boundary, micro-batch)``: the same value for a send and its receive."""

CHANNELS: dict[Kind, tuple[str, int, bool]] = {
    Kind.SEND_F: ("F", 0, False),
    Kind.RECV_F: ("F", -1, False),
    Kind.SEND_B: ("B", -1, False),
    Kind.RECV_B: ("B", 0, False),
    Kind.SEND_T: ("T", 0, True),
    Kind.RECV_T: ("T", 0, True),
    Kind.SEND_O: ("O", 0, True),
    Kind.RECV_O: ("O", 0, True),
}
"""Send or receive kind -> (family, offset from the action's stage to the boundary it
crosses, whether it carries the whole step rather than a boundary's tensors)."""

RECEIVES: dict[Kind, tuple[Kind, int]] = {
    Kind.SEND_F: (Kind.RECV_F, 1),
    Kind.SEND_B: (Kind.RECV_B, -1),
    Kind.SEND_O: (Kind.RECV_O, 0),
}
"""Send kind -> (matching receive kind, offset from the sending to the receiving stage);
the targets (``SEND_T``) go to the last stage."""

NEEDS: dict[Kind, tuple[Kind, Kind, int]] = {
    Kind.FORWARD: (Kind.RECV_F, Kind.FORWARD, -1),
    Kind.BACKWARD: (Kind.RECV_B, Kind.BACKWARD, 1),
}
"""Compute kind -> (receive kind, producing kind, offset to the producing stage): a forward
takes the previous stage's outputs, a backward the next stage's input gradients. Where the
producing stage does not exist, it reads the step's data (or the loss) instead."""

HANDS_ON: dict[Kind, tuple[Kind, int]] = {
    Kind.FORWARD: (Kind.SEND_F, 1),
    Kind.BACKWARD: (Kind.SEND_B, -1),
}
"""Compute kind -> (send kind, offset to the consuming stage), where that stage exists."""


def rank_of(stage_ranks: Sequence[Sequence[int]], stage: int, microbatch: int) -> int:
    """The rank that runs ``microbatch`` of ``stage``: round-robin over its replicas."""
    replicas = stage_ranks[stage]
    return replicas[microbatch % len(replicas)]


def channel(action: Action) -> Channel:
    """The channel a send or receive uses."""
    family, offset, whole_step = CHANNELS[action.kind]
    return (family, 0 if whole_step else action.stage + offset)


def message(action: Action) -> MessageKey:
    """The key of the message a send or receive carries, equal on both sides."""
    family, offset, whole_step = CHANNELS[action.kind]
    return (family, 0 if whole_step else action.stage + offset, action.microbatch)


def received_by(send: Action, last_stage: int, sender: int | None = None) -> Action:
    """The receive, on ``send.peer``, that takes the message of ``send``; its peer is
    ``sender`` (unset by default)."""
    kind, stage, microbatch = receive_key(send, last_stage)
    return Action(kind, stage, microbatch, sender)


def receive_key(send: Action, last_stage: int) -> tuple[Kind, int, int | None]:
    """``(kind, stage, micro-batch)`` of the receive that takes the message of ``send``."""
    found = RECEIVES.get(send.kind)
    if found is None:  # the targets go to the last stage
        return (Kind.RECV_T, last_stage, send.microbatch)
    return (found[0], send.stage + found[1], send.microbatch)


def produced_by(send: Action) -> tuple[Kind, int, int | None] | None:
    """``(kind, stage, micro-batch)`` of the compute whose result a send carries; ``None``
    for the targets, which come with the step's data."""
    kind = send.kind
    if kind is Kind.SEND_F or kind is Kind.SEND_O:
        return (Kind.FORWARD, send.stage, send.microbatch)
    if kind is Kind.SEND_B:
        return (Kind.BACKWARD, send.stage, send.microbatch)
    return None


def needed_by(action: Action, last_stage: int) -> tuple[Kind, Kind, int] | None:
    """What a forward or backward consumes from a neighbouring stage: ``(receive kind,
    producing kind, producing stage)``, or ``None`` (see :data:`NEEDS`)."""
    need = NEEDS.get(action.kind)
    if need is None:
        return None
    source = action.stage + need[2]
    return (need[0], need[1], source) if 0 <= source <= last_stage else None


def sent_after(action: Action, last_stage: int) -> tuple[Kind, int] | None:
    """What a forward or backward hands on: ``(send kind, consuming stage)``, or ``None``."""
    out = HANDS_ON.get(action.kind)
    if out is None:
        return None
    target = action.stage + out[1]
    return (out[0], target) if 0 <= target <= last_stage else None
