"""What the executor needs from a transport: point-to-point tensors and one all-reduce.

A transport moves tuples of tensors between the ranks of a group. ``channel`` names a
stream of messages between two ranks (:func:`pipetrain.schedules.messages.channel` of a
send or receive); both ends use the same names in the same order. Sends never block;
receives wait. Implementations: :class:`~pipetrain.distributed.torch_transport.TorchTransport`
over torch.distributed, :class:`~pipetrain.distributed.loopback.LoopbackTransport` between
threads of one process. Both speak the protocol of :mod:`pipetrain.distributed.framing`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

import torch

Tensors = tuple[torch.Tensor, ...]


class PendingReceive(Protocol):
    """A receive posted ahead of need."""

    def wait(self) -> Tensors:
        """Block until the message is here; return its tensors."""
        ...


class Transport(Protocol):
    """Tensors between the ranks of one group, and the sum of a tensor over all of them."""

    @property
    def device(self) -> torch.device:
        """Where received tensors are placed."""
        ...

    @property
    def channels_apart(self) -> bool:
        """Whether messages from one peer are matched channel by channel (each schedule
        channel's in its own order), so that a receive may be outstanding on every channel
        of a peer at once; otherwise every message from a peer is matched in one order."""
        ...

    def global_rank(self, peer: int) -> int:
        """The default group's rank of ``peer``, a rank of this transport's group."""
        ...

    def send(self, tensors: Sequence[torch.Tensor], peer: int, channel: Hashable) -> None:
        """Start sending ``tensors`` to ``peer``; returns at once."""
        ...

    def post_receive(self, peer: int, channel: Hashable) -> PendingReceive:
        """Post the receive of the next message from ``peer`` on ``channel``."""
        ...

    def receive(self, peer: int, channel: Hashable) -> Tensors:
        """Receive the next message from ``peer`` on ``channel`` (blocking)."""
        ...

    def flush(self) -> None:
        """Wait until every send has completed."""
        ...

    def yield_to_sends(self) -> None:
        """Called before this thread computes: let the link move the bytes of a send still
        under way now, where it moves them on a thread that waits for a free core."""
        ...

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Replace ``tensor`` by its sum over every rank of the group (blocking)."""
        ...

    def all_reduce_start(self, tensor: torch.Tensor) -> Callable[[], None]:
        """Start :meth:`all_reduce`; return the wait for its sum."""
        ...


class PeerError(RuntimeError):
    """Communication with a peer rank failed or timed out."""

    def __init__(self, peer: int | None, detail: str) -> None:
        """Record which peer did not answer (``None``: the group as a whole) and why."""
        who = "the group" if peer is None else f"rank {peer}"
        super().__init__(f"communication with {who} failed: {detail}")
        self.peer = peer
