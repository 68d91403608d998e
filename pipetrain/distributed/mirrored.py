"""One pipeline rank played by a group of processes that mirror each other (tensor parallelism).

With tensor parallelism of degree ``T``, each rank of a schedule is a group of ``T``
consecutive processes of the world (rank ``r`` is processes ``r·T`` to ``r·T + T − 1``)
that run the same actions on their parts of each stage. The tensors passing between
stages are the same on all of them, so they cross the link once: the group's first process
(its leader) sends to the leader of the peer's group, and a receiving leader broadcasts
what arrived to its group. :class:`MirroredTransport` does this over a
:class:`~pipetrain.distributed.torch_transport.TorchTransport` of the whole world, speaking
the schedule's ranks; its all-reduces sum over every process.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable, Sequence

import torch
import torch.distributed as dist

from pipetrain.distributed.framing import (
    HEADER_SLOTS,
    SHAPES_FOLLOW,
    TRAILER,
    Layout,
    decode_header,
    describe,
    encode_header,
)
from pipetrain.distributed.torch_transport import TorchTransport
from pipetrain.distributed.transport import PendingReceive, Tensors


def _settle(tensors: Sequence[torch.Tensor]) -> None:
    """Wait for the collectives still producing any of ``tensors`` (DTensor's asynchronous
    ones), which a tensor dropped unread would leave pending for good."""
    funcol = sys.modules.get("torch.distributed._functional_collectives")
    if funcol is not None:
        for tensor in tensors:
            if isinstance(tensor, funcol.AsyncCollectiveTensor):
                tensor.wait()


class _Mirrored:
    """A receive that the leader takes from the link and the group gets by broadcast."""

    def __init__(
        self, transport: MirroredTransport, inner: PendingReceive | None, key: Hashable
    ) -> None:
        self._transport, self._inner, self._key = transport, inner, key

    def wait(self) -> Tensors:
        """The message's tensors, on every process of the group (blocking)."""
        tensors = None if self._inner is None else self._inner.wait()
        return self._transport.broadcast(tensors, self._key)


class MirroredTransport:
    """A :class:`~pipetrain.distributed.transport.Transport` for the schedule's ranks when each
    is played by ``degree`` consecutive processes of ``world``'s group; ``group`` is this
    process's own group of mirrors (a process group of those ``degree`` processes)."""

    def __init__(self, world: TorchTransport, degree: int, group: dist.ProcessGroup) -> None:
        """Send and receive through ``world`` (a transport over every process), broadcasting
        received messages within ``group``."""
        self.world, self.degree, self.group = world, degree, group
        me = dist.get_rank(world.group)
        self.leader = me - me % degree  # this group's first process, in world's group
        self.leads = me == self.leader
        self._source = dist.get_global_rank(group, 0)
        self._wire = world.wire_device
        self._layouts: dict[Hashable, Layout] = {}  # by (peer, channel)

    @property
    def device(self) -> torch.device:
        """Where received tensors are placed."""
        return self.world.device

    @property
    def channels_apart(self) -> bool:
        """Whether the leaders' link matches each channel's messages apart."""
        return self.world.channels_apart

    def global_rank(self, peer: int) -> int:
        """The default group's rank of ``peer``'s leader (``peer``: a schedule rank)."""
        return self.world.global_rank(peer * self.degree)

    def send(self, tensors: Sequence[torch.Tensor], peer: int, channel: Hashable) -> None:
        """The leader starts sending ``tensors`` to ``peer``'s leader; the others send
        nothing (the peer's leader shares what it receives)."""
        if self.leads:
            self.world.send(tensors, peer * self.degree, channel)
        else:
            _settle(tensors)

    def post_receive(self, peer: int, channel: Hashable) -> PendingReceive:
        """Post the receive of the next message from ``peer`` on ``channel``: the leader's
        from the link; every process gets it by broadcast when it waits."""
        inner = self.world.post_receive(peer * self.degree, channel) if self.leads else None
        return _Mirrored(self, inner, (peer, channel))

    def receive(self, peer: int, channel: Hashable) -> Tensors:
        """Receive the next message from ``peer`` on ``channel`` (blocking)."""
        return self.post_receive(peer, channel).wait()

    def broadcast(self, tensors: Tensors | None, key: Hashable) -> Tensors:
        """The leader's ``tensors`` on every process of the group (others give ``None``), as
        framed messages travel: shapes and dtypes once per ``key`` (peer and channel), then
        each message's bytes in one buffer; a change of shapes is announced by the trailer
        of a buffer of the old size, which the new shapes and the message's buffer follow."""
        previous = self._layouts.get(key)
        if tensors is not None:
            metas = describe(tensors)
            if previous is None or previous.metas != metas:
                if previous is not None:
                    stale = torch.zeros(previous.size, dtype=torch.uint8, device=self._wire)
                    stale[-TRAILER] = SHAPES_FOLLOW
                    self._share(stale)
                self._share(encode_header(metas).to(self._wire))
                previous = self._layouts[key] = Layout(metas)
            self._share(previous.pack(tensors, self._wire))
            return tensors
        if previous is not None:
            buffer = self._share(torch.empty(previous.size, dtype=torch.uint8, device=self._wire))
            if int(buffer[-TRAILER]) != SHAPES_FOLLOW:
                return self._received(buffer, previous)
        header = self._share(torch.zeros(HEADER_SLOTS, dtype=torch.int64, device=self._wire))
        layout = self._layouts[key] = Layout(decode_header(header.cpu()))
        buffer = torch.empty(layout.size, dtype=torch.uint8, device=self._wire)
        return self._received(self._share(buffer), layout)

    def _share(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as the group's first process has it (a broadcast from it)."""
        dist.broadcast(tensor, src=self._source, group=self.group)
        return tensor

    def _received(self, buffer: torch.Tensor, layout: Layout) -> Tensors:
        return tuple(t.to(self.device) for t in layout.unpack(buffer))

    def yield_to_sends(self) -> None:
        """The leader's link moves its sends' bytes now (the others send nothing)."""
        self.world.yield_to_sends()

    def flush(self) -> None:
        """Wait until every send has completed."""
        self.world.flush()

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Replace ``tensor`` by its sum over every process (blocking)."""
        self.world.all_reduce(tensor)

    def all_reduce_start(self, tensor: torch.Tensor) -> Callable[[], None]:
        """Start :meth:`all_reduce`; return the wait for its sum."""
        return self.world.all_reduce_start(tensor)
