"""The message protocol over torch.distributed point-to-point operations.

Sends are asynchronous (``isend``); receives can be posted early and waited on later.
Gloo cannot send from GPU memory, so under gloo a GPU stage's messages travel through
pinned host buffers. Every wait, for a transfer or the transport's all-reduces, ends within
the timeout, and names the peer waited for when it froze or cannot be reached
(:mod:`pipetrain.distributed.heartbeat`), before the timeout if ``frozen_after_s`` is shorter.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from pipetrain.distributed.framing import FramedTransport, Work
from pipetrain.distributed.heartbeat import Watch, beat
from pipetrain.distributed.transport import PeerError


def _wire_device(device: torch.device, group: dist.ProcessGroup | None) -> torch.device:
    """Where messages of a stage on ``device`` travel from: the device itself, or the host
    when the backend cannot send from it (gloo with CUDA tensors)."""
    if device.type == "cuda" and dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    return device


class TorchTransport(FramedTransport):
    """Sends and receives stage tensors over a torch.distributed process group."""

    def __init__(
        self,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        timeout_s: float = 300.0,
        frozen_after_s: float | None = None,
    ) -> None:
        """Use ``group`` (the default group if ``None``); a wait longer than ``timeout_s``,
        or for a peer whose heartbeat has stood still for ``frozen_after_s`` (by default
        ``timeout_s``), raises :class:`PeerError`."""
        super().__init__(device, _wire_device(device, group), timeout_s)
        self.group = group
        # NCCL's waits order GPU streams, which belong to the caller's thread, and NCCL
        # has a watchdog of its own: there the caller waits itself
        frozen_after = None if frozen_after_s is None else timedelta(seconds=frozen_after_s)
        self._watch = (
            None if dist.get_backend(group) == "nccl" else Watch(self.timeout, frozen_after)
        )
        if self._watch is not None:
            beat()
        # gloo moves a message's bytes on its event-loop thread, which pipetrain marks
        # SCHED_BATCH (distributed/io_threads.py): woken while this thread computes, it
        # waits for a core until this thread blocks or the scheduler's tick (4 ms here),
        # and the receiver with it; yielding once a send is posted, and before computing
        # while one is under way, lets it run at once
        gloo = dist.get_backend(group) == "gloo"
        self._yield = os.sched_yield if gloo else None
        # gloo matches point-to-point messages by tag, so each schedule channel's receive
        # can be posted at once; NCCL ignores tags and matches a pair's messages in order
        self.channels_apart = gloo
        me = dist.get_rank()
        self._others = [r for r in dist.get_process_group_ranks(group or _world()) if r != me]

    def global_rank(self, peer: int) -> int:
        """The default group's rank of ``peer``, a rank of this transport's group."""
        return peer if self.group is None else dist.get_global_rank(self.group, peer)

    def _buffer(self, size: int) -> torch.Tensor:
        """An uninitialised byte buffer (pinned when it stages a GPU's data)."""
        return torch.empty(
            size, dtype=torch.uint8, device=self.wire_device, pin_memory=self._staged
        )

    def _wait(self, work: Work, peer: int | None) -> None:
        others = self._others if peer is None else [self.global_rank(peer)]
        self._await(work, peer, others, "answer")

    def _await(self, work: Work, peer: int | None, peers: list[int], what: str) -> None:
        """Wait for ``work`` with the global ranks ``peers`` (``peer``: the group's rank
        named in errors; ``None``: the whole group)."""
        if self._watch is None:
            super()._wait(work, peer)
            return
        try:
            finished = self._watch.wait(work, peers)
        except PeerError:
            raise
        except RuntimeError as error:
            raise PeerError(peer, str(error)) from error
        if not finished:
            raise PeerError(peer, f"no {what} within {self.timeout.total_seconds():g} s")

    def _irecv(self, buffer: torch.Tensor, peer: int, tag: int) -> dist.Work:
        source = self.global_rank(peer)
        return _started(dist.irecv(buffer, src=source, group=self.group, tag=tag), peer)

    def _isend(self, buffer: torch.Tensor, peer: int, tag: int) -> dist.Work:
        target = self.global_rank(peer)
        return _started(dist.isend(buffer, dst=target, group=self.group, tag=tag), peer)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the group, in place."""
        self.all_reduce_start(tensor)()

    def all_reduce_start(self, tensor: torch.Tensor) -> Callable[[], None]:
        """Start summing ``tensor`` over the group, in place; return the wait for the sum,
        which raises :class:`PeerError` as a receive's does. Every rank must start its
        all-reduces in the same order."""
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        assert work is not None  # async_op=True always returns the work

        def wait() -> None:
            self._await(work, None, self._others, "all-reduce")

        return wait


def _world() -> dist.ProcessGroup:
    """The default process group."""
    return dist.distributed_c10d._get_default_group()


def _started(work: dist.Work | None, peer: int) -> dist.Work:
    """The work of a transfer torch.distributed started; it starts none for a rank outside
    the group."""
    if work is None:
        raise PeerError(peer, "this rank is not a member of the transport's process group")
    return work


def indexed(device: torch.device | str) -> torch.device:
    """``device`` with its index: a GPU named without one is the current GPU (a captured
    graph's checks compare indices, so ``cuda`` is not ``cuda:0`` there)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def default_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device of this process: its local GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        return torch.device("cuda", local)
    return torch.device("cpu")
