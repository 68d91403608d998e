"""In-process ranks: threads that exchange messages through shared queues.

Each ordered pair of ranks has a first-in first-out queue of byte buffers, so the framing
protocol of :mod:`pipetrain.distributed.framing` runs unchanged and buffers are matched in the
order they were sent, as torch.distributed matches them. A receive whose buffer has another
size than the message that arrives fails, as it does under torch.distributed, so a protocol
error shows here too. Used to test the protocol and the executor without processes.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch

from pipetrain.distributed.framing import FramedTransport
from pipetrain.distributed.transport import PeerError

T = TypeVar("T")
_POLL_S = 0.02  # how often a waiting receive looks for a failed rank


class LoopbackGroup:
    """``size`` ranks in one process; :meth:`run` runs a function on each in its own thread."""

    def __init__(self, size: int, timeout_s: float = 10.0) -> None:
        """A group of ``size`` ranks whose waits give up after ``timeout_s``."""
        self.size, self.timeout_s = size, timeout_s
        self._queues: dict[tuple[int, int], queue.Queue[torch.Tensor]] = {
            (sender, receiver): queue.Queue() for sender in range(size) for receiver in range(size)
        }
        self._barrier = _Meeting(size)
        self._contributions: dict[int, torch.Tensor] = {}
        self._failures: list[tuple[int, BaseException]] = []
        self._lock = threading.Lock()

    def transport(self, rank: int, device: torch.device | None = None) -> LoopbackTransport:
        """The transport of ``rank`` (on the CPU unless ``device`` is given)."""
        return LoopbackTransport(self, rank, device or torch.device("cpu"), self.timeout_s)

    def run(self, fn: Callable[[LoopbackTransport], T]) -> list[T]:
        """``fn(transport)`` on every rank at once, each in a thread; the results by rank.

        If any rank raises, the others' waits fail soon after, and the first error raised
        is raised here; the group then stays failed.
        """
        results: dict[int, T] = {}

        def work(rank: int) -> None:
            try:
                results[rank] = fn(self.transport(rank))
            except BaseException as error:  # handed to the caller below
                with self._lock:
                    self._failures.append((rank, error))
                self._barrier.abort()

        threads = [threading.Thread(target=work, args=(rank,)) for rank in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if self._failures:
            raise self._failures[0][1]
        return [results[rank] for rank in range(self.size)]

    def errors(self) -> dict[int, BaseException]:
        """The error each failed rank raised, by rank."""
        with self._lock:
            return dict(self._failures)

    def failed(self) -> int | None:
        """The rank that failed first, or ``None``."""
        with self._lock:
            return self._failures[0][0] if self._failures else None

    def put(self, sender: int, receiver: int, buffer: torch.Tensor) -> None:
        """Deliver ``buffer`` from ``sender`` to ``receiver``."""
        self._queues[(sender, receiver)].put(buffer)

    def take(self, sender: int, receiver: int, deadline: float) -> torch.Tensor | None:
        """The next buffer from ``sender`` to ``receiver``; ``None`` once ``deadline`` (a
        :func:`time.monotonic` time) passes. Raises if a rank has failed meanwhile."""
        pipe = self._queues[(sender, receiver)]
        while True:
            try:
                return pipe.get(timeout=max(0.0, min(_POLL_S, deadline - time.monotonic())))
            except queue.Empty:
                origin = self.failed()
                if origin is not None:
                    raise RuntimeError(f"rank {origin} failed") from None
                if time.monotonic() >= deadline:
                    return None

    def all_reduce(self, rank: int, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in rank order so that every rank gets the same float."""
        self._contributions[rank] = tensor.detach().clone()
        self._meet()
        total = torch.zeros_like(tensor)
        for other in range(self.size):
            total += self._contributions[other]
        self._meet()  # nobody overwrites a contribution before every rank has read them
        tensor.copy_(total)

    def _meet(self) -> None:
        if not self._barrier.wait(self.timeout_s):
            origin = self.failed()
            detail = f"rank {origin} failed" if origin is not None else "a rank did not arrive"
            raise PeerError(None, f"all-reduce: {detail}")


class _Meeting:
    """A barrier whose completed rounds stay completed: a rank that leaves a round and then
    fails (aborting the meeting) cannot break that round for a peer not yet woken, as it
    can a :class:`threading.Barrier`."""

    def __init__(self, size: int) -> None:
        self.size, self._arrived, self._round, self._aborted = size, 0, 0, False
        self._cond = threading.Condition()

    def wait(self, timeout_s: float) -> bool:
        """Whether every rank arrived in this round (``False``: aborted or timed out)."""
        with self._cond:
            round_ = self._round
            self._arrived += 1
            if self._arrived == self.size:
                self._arrived, self._round = 0, self._round + 1
                self._cond.notify_all()
                return True
            self._cond.wait_for(lambda: self._round != round_ or self._aborted, timeout_s)
            return self._round != round_

    def abort(self) -> None:
        """Release every waiting rank, which then sees its round incomplete."""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()


class _Sent:
    """A loopback send: delivered at once."""

    def wait(self, timeout: timedelta) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Arrival:
    """A loopback receive into ``buffer``, completed by :meth:`wait`."""

    def __init__(
        self, group: LoopbackGroup, sender: int, receiver: int, buffer: torch.Tensor
    ) -> None:
        self._group, self._sender, self._receiver, self._buffer = group, sender, receiver, buffer

    def is_completed(self) -> bool:
        return False  # the message is taken by wait

    def wait(self, timeout: timedelta) -> bool:
        deadline = time.monotonic() + timeout.total_seconds()
        message = self._group.take(self._sender, self._receiver, deadline)
        if message is None:
            return False
        expected = self._buffer.numel() * self._buffer.element_size()
        arrived = message.numel() * message.element_size()
        if arrived != expected:
            raise RuntimeError(
                f"a message of {arrived} bytes arrived where {expected} were expected"
            )
        self._buffer.view(torch.uint8).copy_(message.view(torch.uint8))
        return True


class LoopbackTransport(FramedTransport):
    """One rank's transport in a :class:`LoopbackGroup`."""

    def __init__(
        self, group: LoopbackGroup, rank: int, device: torch.device, timeout_s: float
    ) -> None:
        """Rank ``rank`` of ``group``; messages are received onto ``device``."""
        super().__init__(device, torch.device("cpu"), timeout_s)
        self.group, self.rank = group, rank

    def global_rank(self, peer: int) -> int:
        """A loopback group is the whole world: ranks are their own global ranks."""
        return peer

    def _isend(self, buffer: torch.Tensor, peer: int, tag: int) -> _Sent:
        self.group.put(self.rank, peer, buffer)
        return _Sent()

    def _irecv(self, buffer: torch.Tensor, peer: int, tag: int) -> _Arrival:
        return _Arrival(self.group, peer, self.rank, buffer)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the group, in place."""
        self.group.all_reduce(self.rank, tensor)

    def all_reduce_start(self, tensor: torch.Tensor) -> Callable[[], None]:
        """Sum ``tensor`` over the group now; the returned wait has nothing left to do."""
        self.all_reduce(tensor)
        return lambda: None
