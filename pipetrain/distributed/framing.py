"""The message protocol every transport speaks, over any link that moves byte buffers.

A message is the tensors packed into one byte buffer followed by an 8-byte trailer.
Shapes and dtypes travel once per channel, in a small header, and are then reused: both
ends remember them. When the shapes change (a smaller last micro-batch, say), the sender
sends one buffer of the old size with the trailer set, then the new header, then the
data, so the receiver always knows how many bytes to expect. Every buffer of a channel
carries the channel's tag where the link matches tags apart (so each channel's messages
are matched in an order of their own), else tag 0. A subclass of
:class:`FramedTransport` provides the link: buffers, asynchronous sends and receives.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch

from pipetrain.distributed.transport import PeerError, Tensors
from pipetrain.schedules.messages import channel_tag

_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
HEADER_SLOTS = 64
TRAILER = 8
_ALIGN = 16
SHAPES_FOLLOW = 1  # a trailer value: new shapes follow this buffer
Signature = tuple[tuple[torch.Size, torch.dtype, bool], ...]
"""Each tensor's shape, dtype and grad requirement, as a send compares them."""


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and grad requirement of one tensor in a message."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


def describe(tensors: Sequence[torch.Tensor]) -> tuple[TensorMeta, ...]:
    """The metadata of each tensor, as both ends of a channel see it."""
    return tuple(TensorMeta(tuple(t.shape), t.dtype, t.requires_grad) for t in tensors)


def _offsets(metas: Sequence[TensorMeta]) -> tuple[list[int], int]:
    """Each tensor's byte offset in a message of tensors ``metas``, and the data's size."""
    offsets, position = [], 0
    for meta in metas:
        offsets.append(position)
        position += -(-meta.nbytes // _ALIGN) * _ALIGN
    return offsets, position


def encode_header(metas: Sequence[TensorMeta]) -> torch.Tensor:
    """Metadata as a fixed-size int64 tensor."""
    slots = [len(metas)]
    for meta in metas:
        if meta.dtype not in _DTYPES:
            raise TypeError(
                f"cannot send tensors of dtype {meta.dtype} between stages; use one of {_DTYPES}"
            )
        slots += [_DTYPES.index(meta.dtype), int(meta.requires_grad), len(meta.shape), *meta.shape]
    if len(slots) > HEADER_SLOTS:
        raise ValueError(
            f"a stage output of {len(metas)} tensors with shapes {[m.shape for m in metas]} needs "
            f"{len(slots)} header slots, more than {HEADER_SLOTS}; return fewer or flatter tensors"
        )
    return torch.tensor(slots + [0] * (HEADER_SLOTS - len(slots)), dtype=torch.int64)


def decode_header(header: torch.Tensor) -> tuple[TensorMeta, ...]:
    """The inverse of :func:`encode_header`."""
    slots = header.tolist()
    metas, position = [], 1
    for _ in range(slots[0]):
        dtype, requires_grad, ndim = slots[position : position + 3]
        shape = tuple(slots[position + 3 : position + 3 + ndim])
        metas.append(TensorMeta(shape, _DTYPES[dtype], bool(requires_grad)))
        position += 3 + ndim
    return tuple(metas)


class Layout:
    """Where each tensor of a message of tensors ``metas`` lies in its byte buffer, worked
    out once per channel's shapes: offsets aligned to 16 bytes, zeros between, then the
    trailer."""

    def __init__(self, metas: tuple[TensorMeta, ...]) -> None:
        """The layout of messages of tensors ``metas``."""
        self.metas = metas
        self.offsets, data = _offsets(metas)
        self.size = data + TRAILER
        ends = [*self.offsets[1:], data]
        gaps = [end - offset - meta.nbytes for meta, offset, end in zip(metas, self.offsets, ends)]
        # the zero bytes after each tensor, the trailer's with the last's
        self._fill = [*gaps[:-1], (gaps[-1] if gaps else 0) + TRAILER]
        self._zeros: dict[torch.device, list[torch.Tensor | None]] = {}

    def pack(self, tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """A new buffer on ``device`` holding ``tensors`` (whose metadata is this layout's)
        and a trailer of zeros: no new shapes follow."""
        if not tensors:
            return torch.zeros(self.size, dtype=torch.uint8, device=device)
        zeros = self._zeros.get(device)
        if zeros is None:
            zeros = self._zeros[device] = [
                torch.zeros(size, dtype=torch.uint8, device=device) if size else None
                for size in self._fill
            ]
        pieces: list[torch.Tensor] = []
        for tensor, filler in zip(tensors, zeros):
            pieces.append(tensor.detach().to(device).reshape(-1).view(torch.uint8))
            if filler is not None:
                pieces.append(filler)
        return torch.cat(pieces)

    def unpack(self, buffer: torch.Tensor) -> Tensors:
        """The tensors in ``buffer``: views of it."""
        return tuple(
            buffer[offset : offset + meta.nbytes].view(meta.dtype).view(meta.shape)
            for meta, offset in zip(self.metas, self.offsets)
        )


class Work(Protocol):
    """An asynchronous send or receive of one buffer on a link."""

    def wait(self, timeout: timedelta) -> bool:
        """Block until done; ``False`` (or an error) if not done within ``timeout``."""
        ...

    def is_completed(self) -> bool:
        """Whether it is done already (then :meth:`wait` returns at once)."""
        ...


class FramedReceive:
    """A posted receive: call :meth:`wait` for the tensors."""

    def __init__(self, transport: FramedTransport, peer: int, channel: Hashable) -> None:
        """Post the receive of the next message on ``channel`` from ``peer``."""
        self._transport, self._peer, self._channel = transport, peer, channel
        self._tag = transport._tag(channel)
        layout = transport._received_layouts.get((peer, channel))
        self._posted = None if layout is None else self._post_data(layout)

    def _post_data(self, layout: Layout) -> tuple[Layout, torch.Tensor, Work]:
        buffer = self._transport._buffer(layout.size)
        return layout, buffer, self._transport._irecv(buffer, self._peer, self._tag)

    def wait(self) -> Tensors:
        """Block until the message is here; return its tensors (views of one buffer)."""
        transport, key = self._transport, (self._peer, self._channel)
        while True:
            if self._posted is None:
                header = transport._buffer(HEADER_SLOTS * 8).view(torch.int64)
                transport._wait(transport._irecv(header, self._peer, self._tag), self._peer)
                layout = Layout(decode_header(header.cpu()))
                transport._received_layouts[key] = layout
                self._posted = self._post_data(layout)
            layout, buffer, work = self._posted
            transport._wait(work, self._peer)
            if int(buffer[-TRAILER]) != SHAPES_FOLLOW:
                if transport._staged:
                    buffer = buffer.to(transport.device, non_blocking=True)
                return layout.unpack(buffer)
            self._posted = None


class FramedTransport(ABC):
    """The message protocol over a link that subclasses provide.

    Implements :class:`~pipetrain.distributed.transport.Transport` but for ``global_rank`` and
    ``all_reduce``, which belong to the group behind the link.
    """

    def __init__(self, device: torch.device, wire_device: torch.device, timeout_s: float) -> None:
        """Receive onto ``device``; buffers travel from ``wire_device``; a wait longer than
        ``timeout_s`` raises :class:`PeerError`."""
        self.device = device
        self.wire_device = wire_device
        self._staged = wire_device != device  # messages pass through the wire's buffers
        self.timeout = timedelta(seconds=timeout_s)
        # by (peer, channel): the tensors' shapes, dtypes and grad requirements as last
        # sent, with their layout; the layout last received
        self._sending: dict[tuple[int, Hashable], tuple[Signature, Layout]] = {}
        self._received_layouts: dict[tuple[int, Hashable], Layout] = {}
        self._tags: dict[Hashable, int] = {}
        self._pending_sends: list[tuple[Work, int]] = []

    @abstractmethod
    def _isend(self, buffer: torch.Tensor, peer: int, tag: int) -> Work:
        """Start sending ``buffer`` to ``peer`` with ``tag`` (see :meth:`_tag`)."""

    @abstractmethod
    def _irecv(self, buffer: torch.Tensor, peer: int, tag: int) -> Work:
        """Start receiving the next buffer with ``tag`` from ``peer`` into ``buffer`` (of
        its size)."""

    channels_apart = False
    """Whether the link matches buffers of different tags apart (see :meth:`_tag`)."""

    _yield: Callable[[], None] | None = None
    """Gives up the core at once, where the link moves bytes on a thread that waits for one
    (see :meth:`yield_to_sends`); ``None`` where it does not."""

    def _tag(self, channel: Hashable) -> int:
        """The tag of ``channel``'s buffers: its own for each schedule channel where the
        link matches tags apart, else 0 (one order for every buffer from a peer)."""
        tag = self._tags.get(channel)
        if tag is None:
            tag = self._tags[channel] = channel_tag(channel) if self.channels_apart else 0
        return tag

    def _buffer(self, size: int) -> torch.Tensor:
        """An uninitialised byte buffer on the wire device."""
        return torch.empty(size, dtype=torch.uint8, device=self.wire_device)

    def _wait(self, work: Work, peer: int | None) -> None:
        try:
            finished = work.wait(self.timeout)
        except RuntimeError as error:
            raise PeerError(peer, str(error)) from error
        if finished is False:
            raise PeerError(peer, f"no answer within {self.timeout.total_seconds():g} s")

    def _post(self, buffer: torch.Tensor, peer: int, tag: int) -> None:
        self._pending_sends.append((self._isend(buffer, peer, tag), peer))
        if self._yield is not None:
            self._yield()

    def yield_to_sends(self) -> None:
        """Called before this thread computes: if the last send is still under way, give up
        the core once, so the link's thread moves its bytes now rather than once this
        thread next blocks."""
        pending = self._pending_sends
        if self._yield is not None and pending and not pending[-1][0].is_completed():
            self._yield()

    def send(self, tensors: Sequence[torch.Tensor], peer: int, channel: Hashable) -> None:
        """Start sending ``tensors`` to ``peer``; returns at once."""
        key = (peer, channel)
        signature = tuple((t.shape, t.dtype, t.requires_grad) for t in tensors)
        sending = self._sending.get(key)
        if sending is None or sending[0] != signature:
            sending = self._sending[key] = self._announce(tensors, signature, peer, channel)
        layout = sending[1]
        buffer = layout.pack(tensors, self.device)
        if self._staged:
            buffer = self._buffer(layout.size).copy_(buffer)
        self._post(buffer, peer, self._tag(channel))

    def _announce(
        self, tensors: Sequence[torch.Tensor], signature: Signature, peer: int, channel: Hashable
    ) -> tuple[Signature, Layout]:
        """Send the new shapes of ``channel``'s messages to ``peer``: after a buffer of the
        old size whose trailer says they follow, if there were shapes before."""
        previous, tag = self._sending.get((peer, channel)), self._tag(channel)
        if previous is not None:
            stale = self._buffer(previous[1].size).zero_()
            stale[-TRAILER] = SHAPES_FOLLOW
            self._post(stale, peer, tag)
        metas = describe(tensors)
        self._post(encode_header(metas).to(self.wire_device), peer, tag)
        return signature, Layout(metas)

    def post_receive(self, peer: int, channel: Hashable) -> FramedReceive:
        """Post the receive of the next message from ``peer`` on ``channel``."""
        return FramedReceive(self, peer, channel)

    def receive(self, peer: int, channel: Hashable) -> Tensors:
        """Receive the next message from ``peer`` on ``channel`` (blocking)."""
        return self.post_receive(peer, channel).wait()

    def flush(self) -> None:
        """Wait until every send has completed (their buffers may then be freed)."""
        pending, self._pending_sends = self._pending_sends, []
        for work, peer in pending:
            self._wait(work, peer)
