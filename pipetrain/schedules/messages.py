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
``b``, between stage ``b`` and ``b + 1``), so one pair of ranks may carry several; a send
and the receive it matches are on the same channel with the same micro-batch. The tables
below state it (the hot loops read them directly), :func:`channel` gives an action's channel
and :func:`rank_of` is the one routing rule: micro-batch ``k`` of stage ``s`` runs on the
stage's replicas round-robin.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from pipetrain.schedules.actions import Action, Kind

Channel = tuple[str, int]
"""A transport channel: a message family and the boundary it crosses."""

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

CARRIES: dict[Kind, Kind] = {
    Kind.SEND_F: Kind.FORWARD,
    Kind.SEND_O: Kind.FORWARD,
    Kind.SEND_B: Kind.BACKWARD,
}
"""Send kind -> the compute kind, of the same stage and micro-batch, whose result it carries
(the targets, ``SEND_T``, come with the step's data)."""

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


_FAMILIES = tuple(sorted({family for family, _, _ in CHANNELS.values()}))


def channel_tag(name: Hashable) -> int:
    """A positive integer of its own for each channel :func:`channel` names, the same in
    every process, and 0 for any other name: a link that matches messages by tag then
    keeps each channel's messages in an order of their own."""
    if (
        isinstance(name, tuple)
        and len(name) == 2
        and name[0] in _FAMILIES
        and isinstance(name[1], int)
        and name[1] >= 0
    ):
        return 1 + name[1] * len(_FAMILIES) + _FAMILIES.index(name[0])
    return 0
