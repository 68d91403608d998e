"""Signs of life: a waiting rank tells a frozen peer from a slow one, well before the timeout.

Every process that builds a :class:`~pipetrain.distributed.torch_transport.TorchTransport`
runs a daemon thread that adds one to ``pipetrain/heartbeat/<rank>`` in the default
process group's store every :data:`BEAT_S`. A :class:`Watch` runs the transport's waits on
a waiter thread while the caller looks on: once a wait has lasted :data:`BEAT_S`, the
caller reads the counters of the peers it waits for at every beat. A counter that has not
moved for :data:`STALE_S` means that peer's process no longer runs (stopped by a signal or
a debugger, or its machine hung), since its threads stop with it: the wait records that
rank as where the failure began (:mod:`pipetrain.distributed.failure`), so that every rank
names it, and raises :class:`PeerFrozen`. A peer that died breaks its connections, which fails the
wait by itself; a peer that is alive but slow keeps beating and is waited for up to the
timeout.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections.abc import Sequence
from contextlib import suppress
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from pipetrain.distributed.failure import report_origin
from pipetrain.distributed.framing import Work
from pipetrain.distributed.transport import PeerError

BEAT_S = 0.5
STALE_S = 3.0  # six beats missed
_KEY = "pipetrain/heartbeat/"

# the default group beaten for, the event that stops its heartbeat and the beating thread
_beating: tuple[Any, threading.Event, threading.Thread] | None = None


class PeerFrozen(PeerError):
    """A peer's heartbeat stopped while this rank waited for it: its process is frozen."""

    def __init__(self, peer: int, silent_s: float) -> None:
        """Name the frozen ``peer`` (a global rank) and how long it has been silent."""
        self.reason = (
            f"rank {peer} froze: it has given no sign of life for {silent_s:.1f} s (its "
            "process is stopped, by a signal or a debugger, or its machine hangs)"
        )
        super().__init__(peer, self.reason)
        self.silent_s = silent_s


def _store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def beat() -> None:
    """Start this process's heartbeat in the default process group's store (once per group;
    one started for an earlier group stops). Without a store, or with one that cannot open
    a second connection, nothing starts: no peer then takes this rank for frozen."""
    global _beating
    store = _store()
    if store is None:
        return
    group = dist.distributed_c10d._get_default_group()
    if _beating is not None:
        if _beating[0] is group:
            return
        stop_beating()
    try:
        own = store.clone()  # type: ignore[attr-defined]  # its own connection, unshared
    except (RuntimeError, AttributeError):  # a store that cannot be cloned: no heartbeat,
        return  # so no peer ever takes this rank for frozen
    key, stop = f"{_KEY}{dist.get_rank()}", threading.Event()

    def run() -> None:
        while True:
            with suppress(RuntimeError):  # a store that failed once may answer the next beat
                own.add(key, 1)
            if stop.wait(BEAT_S):
                return

    beating = threading.Thread(target=run, name="pipetrain-heartbeat", daemon=True)
    beating.start()
    _beating = (group, stop, beating)


def stop_beating() -> None:
    """Stop this process's heartbeat and wait for its thread to end (a no-op if none
    beats).

    Called before a process group is destroyed and at exit: a daemon thread caught inside
    the store's C++ call while the interpreter finalizes is ended by a forced unwind that
    aborts the process ("terminate called without an active exception"), which a restarting
    launcher reads as a failed worker even though the run had finished."""
    global _beating
    if _beating is None:
        return
    _, stop, beating = _beating
    stop.set()
    beating.join(timeout=5 * BEAT_S)  # one store call at most; never hang an exit on it
    _beating = None


atexit.register(stop_beating)


def _serve(
    jobs: queue.SimpleQueue[Work | None],
    done: threading.Lock,
    outcome: list[bool | BaseException],
    timeout: timedelta,
) -> None:
    """A watch's waiter thread: wait for each work of ``jobs`` (``None``: the watch is gone,
    stop), put how it ended in ``outcome`` and release ``done``. It holds no reference to
    the watch, so that a dropped transport's watch is collected and ends its thread."""
    while (work := jobs.get()) is not None:
        try:
            outcome[0] = work.wait(timeout)
        except BaseException as error:  # handed to the caller, which raises it
            outcome[0] = error
        # Drop the work before waiting for the next: a watch collected at exit would wake
        # this thread to free it there, and freeing a work re-takes the GIL inside a C++
        # destructor, which the finalizing interpreter ends by aborting the process.
        del work
        done.release()


class Watch:
    """Waits for transfers and collectives of one transport, naming a frozen peer."""

    def __init__(self, timeout: timedelta) -> None:
        """A wait fails after ``timeout``, or once a peer waited for has frozen."""
        self.timeout = timeout
        self._jobs: queue.SimpleQueue[Work | None] = queue.SimpleQueue()
        self._done = threading.Lock()
        self._done.acquire()
        self._outcome: list[bool | BaseException] = [False]
        self._seen: dict[int, tuple[bytes, float]] = {}  # peer: counter, when first read
        self._stuck: str | None = None  # a wait given up on, which the waiter still holds
        self._waiter: threading.Thread | None = None

    def __del__(self) -> None:
        """End the waiter thread (once it is done with a wait it may still hold)."""
        self._jobs.put(None)

    def wait(self, work: Work, peers: Sequence[int]) -> bool:
        """Wait for ``work``, which involves the global ranks ``peers``: ``True`` once done,
        ``False`` if not done within the timeout.

        Raises:
            PeerFrozen: a peer's heartbeat stopped during the wait.
            RuntimeError: the work failed (a peer's connection broke), or an earlier wait
                was given up on.
        """
        if self._stuck is not None:
            raise PeerError(None, self._stuck)
        if work.is_completed():  # most sends, and receives whose data is there: no hand-off
            return work.wait(self.timeout)
        if self._waiter is None:
            self._waiter = threading.Thread(
                target=_serve,
                args=(self._jobs, self._done, self._outcome, self.timeout),
                name="pipetrain-wait",
                daemon=True,
            )
            self._waiter.start()
        self._jobs.put(work)
        deadline = time.monotonic() + self.timeout.total_seconds() + STALE_S
        while not self._done.acquire(timeout=BEAT_S):
            frozen = self._frozen(peers)
            if frozen is None and time.monotonic() < deadline:
                continue
            self._stuck = "an earlier wait never ended; the transport cannot be used again"
            if frozen is None:
                return False
            error = PeerFrozen(*frozen)
            report_origin(frozen[0], None, error.reason)  # the culprit, for every rank
            raise error
        outcome = self._outcome[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _frozen(self, peers: Sequence[int]) -> tuple[int, float] | None:
        """The first of ``peers`` whose heartbeat has not moved for :data:`STALE_S`, and
        for how long; peers without a heartbeat are never frozen."""
        store, now = _store(), time.monotonic()
        if store is None:
            return None
        for peer in peers:
            key = f"{_KEY}{peer}"
            try:
                if not store.check([key]):
                    continue
                counter = store.get(key)
            except RuntimeError:  # the store is gone: the wait fails by itself
                return None
            seen = self._seen.get(peer)
            if seen is None or seen[0] != counter:
                self._seen[peer] = (counter, now)
            elif now - seen[1] >= STALE_S:
                return peer, now - seen[1]
        return None
