"""Point-to-point transfer of tensors and tuples of tensors between pipeline ranks.

A message is the tensors packed into one byte buffer followed by an 8-byte trailer.
Shapes and dtypes travel once per channel, in a small header, and are then reused: both
ends remember them. When the shapes change (a smaller last micro-batch, say), the sender
sends one buffer of the old size with the trailer set, then the new header, then the
data, so the receiver always knows how many bytes to expect. Sends are asynchronous;
receives can be posted early and waited on later. Gloo cannot send from GPU memory, so
under gloo a GPU stage's messages travel through pinned host buffers.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

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
_HEADER_SLOTS = 64
_TRAILER = 8
_ALIGN = 16
_SHAPES_FOLLOW = 1


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
    if len(slots) > _HEADER_SLOTS:
        raise ValueError(
            f"a stage output of {len(metas)} tensors with shapes {[m.shape for m in metas]} needs "
            f"{len(slots)} header slots, more than {_HEADER_SLOTS}; return fewer or flatter tensors"
        )
    return torch.tensor(slots + [0] * (_HEADER_SLOTS - len(slots)), dtype=torch.int64)


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


def _wire_device(device: torch.device, group: dist.ProcessGroup | None) -> torch.device:
    """Where messages of a stage on ``device`` travel from: the device itself, or the host
    when the backend cannot send from it (gloo with CUDA tensors)."""
    if device.type == "cuda" and dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    return device


class PendingReceive:
    """A posted receive: call :meth:`wait` for the tensors."""

    def __init__(self, transport: Transport, peer: int, channel: Hashable) -> None:
        """Post the receive of the next message on ``channel`` from ``peer``."""
        self._transport, self._peer, self._channel = transport, peer, channel
        self._metas = transport._received_shapes.get((peer, channel))
        self._buffer = self._work = None
        if self._metas is not None:
            self._post_data()

    def _post_data(self) -> None:
        _, size = _offsets(self._metas)
        self._buffer = self._transport._wire_buffer(size + _TRAILER)
        self._work = self._transport._irecv(self._buffer, self._peer)

    def wait(self) -> tuple[torch.Tensor, ...]:
        """Block until the message is here; return its tensors (views of one buffer)."""
        transport, key = self._transport, (self._peer, self._channel)
        while True:
            if self._metas is None:
                header = torch.empty(_HEADER_SLOTS, dtype=torch.int64, device=transport.wire_device)
                transport._wait(transport._irecv(header, self._peer), self._peer)
                self._metas = transport._received_shapes[key] = decode_header(header.cpu())
                self._post_data()
            transport._wait(self._work, self._peer)
            if int(self._buffer[-_TRAILER]) != _SHAPES_FOLLOW:
                return _unpack(self._buffer.to(transport.device, non_blocking=True), self._metas)
            self._metas = None


def _unpack(buffer: torch.Tensor, metas: Sequence[TensorMeta]) -> tuple[torch.Tensor, ...]:
    offsets, _ = _offsets(metas)
    tensors = []
    for meta, offset in zip(metas, offsets):
        flat = buffer[offset : offset + meta.nbytes].view(meta.dtype)
        tensors.append(flat.view(meta.shape))
    return tuple(tensors)


class Transport:
    """Sends and receives stage tensors over a torch.distributed process group.

    ``channel`` names a stream of messages between two ranks (for example a stage
    boundary and a direction); both ends must use the same names in the same order.
    """

    def __init__(
        self, device: torch.device, group: dist.ProcessGroup | None = None, timeout_s: float = 300.0
    ) -> None:
        """Use ``group`` (the default group if ``None``); a wait longer than ``timeout_s`` raises."""
        self.device = device
        self.group = group
        self.wire_device = _wire_device(device, group)
        self._pinned = self.wire_device != device  # host buffers that stage a GPU's data
        self.timeout = timedelta(seconds=timeout_s)
        self._sent_shapes: dict[tuple[int, Hashable], tuple[TensorMeta, ...]] = {}
        self._received_shapes: dict[tuple[int, Hashable], tuple[TensorMeta, ...]] = {}
        self._pending_sends: list[tuple[dist.Work, int]] = []

    def global_rank(self, peer: int) -> int:
        """The default group's rank of ``peer``, a rank of this transport's group."""
        return peer if self.group is None else dist.get_global_rank(self.group, peer)

    def _wire_buffer(self, size: int) -> torch.Tensor:
        """An uninitialised byte buffer where messages travel from (pinned when it stages a GPU's data)."""
        return torch.empty(
            size, dtype=torch.uint8, device=self.wire_device, pin_memory=self._pinned
        )

    def _irecv(self, buffer: torch.Tensor, peer: int) -> dist.Work:
        return dist.irecv(buffer, src=self.global_rank(peer), group=self.group)

    def _isend(self, buffer: torch.Tensor, peer: int) -> None:
        self._pending_sends.append(
            (dist.isend(buffer, dst=self.global_rank(peer), group=self.group), peer)
        )

    def _wait(self, work: dist.Work, peer: int) -> None:
        try:
            finished = work.wait(self.timeout)
        except RuntimeError as error:
            raise PeerError(peer, str(error)) from error
        if finished is False:
            raise PeerError(peer, f"no answer within {self.timeout.total_seconds():g} s")

    def send(self, tensors: Sequence[torch.Tensor], peer: int, channel: Hashable) -> None:
        """Start sending ``tensors`` to ``peer``; returns at once."""
        metas = describe(tensors)
        key = (peer, channel)
        previous = self._sent_shapes.get(key)
        if previous != metas:
            if previous is not None:
                _, size = _offsets(previous)
                stale = self._wire_buffer(size + _TRAILER).zero_()
                stale[-_TRAILER] = _SHAPES_FOLLOW
                self._isend(stale, peer)
            self._isend(encode_header(metas).to(self.wire_device), peer)
            self._sent_shapes[key] = metas
        offsets, size = _offsets(metas)
        buffer = self._wire_buffer(size + _TRAILER)
        for tensor, meta, offset in zip(tensors, metas, offsets):
            buffer[offset : offset + meta.nbytes].view(meta.dtype).view(meta.shape).copy_(
                tensor.detach()
            )
        buffer[-_TRAILER:] = 0
        self._isend(buffer, peer)

    def post_receive(self, peer: int, channel: Hashable) -> PendingReceive:
        """Post the receive of the next message from ``peer`` on ``channel``."""
        return PendingReceive(self, peer, channel)

    def receive(self, peer: int, channel: Hashable) -> tuple[torch.Tensor, ...]:
        """Receive the next message from ``peer`` on ``channel`` (blocking)."""
        return self.post_receive(peer, channel).wait()

    def flush(self) -> None:
        """Wait until every send has completed (their buffers may then be freed)."""
        pending, self._pending_sends = self._pending_sends, []
        for work, peer in pending:
            self._wait(work, peer)


class PeerError(RuntimeError):
    """Communication with a peer rank failed or timed out."""

    def __init__(self, peer: int, detail: str) -> None:
        """Record which peer did not answer and why."""
        super().__init__(f"communication with rank {peer} failed: {detail}")
        self.peer = peer
