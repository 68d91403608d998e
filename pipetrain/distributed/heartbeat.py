"""Signs of life: a waiting rank tells a frozen or unreachable peer from a slow one.

Every process that builds a :class:`~pipetrain.distributed.torch_transport.TorchTransport`
runs a daemon thread that writes a growing counter to ``pipetrain/heartbeat/<rank>`` in the
default process group's store every :data:`BEAT_S` (and its host and process id once). A
:class:`Watch` whose ``frozen_after`` is shorter than its timeout runs the transport's waits
on a waiter thread while the caller looks on: once a wait has lasted :data:`BEAT_S`, the
caller reads the counters of the peers it waits for at every beat. With the default
``frozen_after`` (the timeout, so that a stall the timeout allows is waited for) the caller
waits itself, and once the timeout has ended the wait reads the counters for
:data:`STILL_BEATS` beats. A counter that has not moved for that long means that peer no
longer runs or cannot be reached: the wait records that rank as where the failure began
(:mod:`pipetrain.distributed.failure`), so that every rank names it, and raises
:class:`PeerFrozen` (its process on this host is stopped or hangs) or
:class:`PeerUnreachable` (on another host: the network or the host is down; or this rank's
own beats no longer reach the store). A peer that died breaks its connections, which fails
the wait by itself; a peer that is alive but slow keeps beating and is waited for up to
the timeout. Values in the store are parsed defensively: a key anyone else wrote that is
not a counter makes no rank look frozen.
"""

from __future__ import annotations

import atexit
import os
import queue
import socket
import threading
import time
from collections.abc import Sequence
from contextlib import suppress
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pipetrain.distributed.failure import report_origin
from pipetrain.distributed.framing import Work
from pipetrain.distributed.transport import PeerError

BEAT_S = 0.5
STILL_BEATS = 2.5  # a heartbeat still this many beats after a timed-out wait: that peer froze
_KEY = "pipetrain/heartbeat/"
_WHERE = "/where"  # after a rank's key: "HOST PID" of its process
_COUNTER_DIGITS = 19  # a counter longer than this was not written by a heartbeat
_OWN_SILENCE_S = 5.0  # this rank's beats failing this long: it is cut off itself

# the default group beaten for, the event that stops its heartbeat and the beating thread
_beating: tuple[Any, threading.Event, threading.Thread] | None = None
_last_beat = [0.0]  # when this process's heartbeat last reached the store (monotonic)


class PeerFrozen(PeerError):
    """A peer's heartbeat stopped while this rank waited for it, and its process (on this
    host) is stopped or hangs."""

    def __init__(self, peer: int, silent_s: float, reason: str | None = None) -> None:
        """Name the frozen ``peer`` (a global rank) and how long it has been silent."""
        self.reason = reason or (
            f"rank {peer} froze: it has given no sign of life for {silent_s:.1f} s (its "
            "process is stopped, by a signal or a debugger, or its machine hangs)"
        )
        super().__init__(peer, self.reason)
        self.silent_s = silent_s


class PeerUnreachable(PeerFrozen):
    """A peer's heartbeat stopped while this rank waited for it, and the peer runs on
    another host (or this rank's own beats no longer reach the store): the network between
    them, or the other host, is down."""


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
    with suppress(RuntimeError):
        own.set(key + _WHERE, f"{socket.gethostname()} {os.getpid()}")

    def run() -> None:
        count = 0
        while True:
            count += 1
            # set, not add: a value planted under this key cannot stop the counter
            with suppress(RuntimeError):  # a store that failed once may answer the next beat
                own.set(key, str(count))
                _last_beat[0] = time.monotonic()
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
    # one store call at most, which a busy machine can stretch to seconds; never hang an exit
    beating.join(timeout=5 * BEAT_S + 10.0)
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

    def __init__(self, timeout: timedelta, frozen_after: timedelta | None = None) -> None:
        """A wait fails after ``timeout``, or once the heartbeat of a peer waited for has
        stood still for ``frozen_after`` (by default ``timeout``: a stall the timeout
        allows is waited for, and a frozen peer is still named as such)."""
        self.timeout = timeout
        self.frozen_after_s = (frozen_after or timeout).total_seconds()
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
        if work.is_completed():  # most sends, and receives whose data is there
            return work.wait(self.timeout)
        if self.frozen_after_s >= self.timeout.total_seconds():
            # nothing to name before the timeout (the default): wait here, since handing
            # the wait to the waiter thread and back costs two thread switches, which
            # doubled the host time of an action on small stages (bench_host_cost.py)
            return self._wait_here(work, peers)
        if self._waiter is None:
            self._waiter = threading.Thread(
                target=_serve,
                args=(self._jobs, self._done, self._outcome, self.timeout),
                name="pipetrain-wait",
                daemon=True,
            )
            self._waiter.start()
        self._jobs.put(work)
        # a counter is first read a beat into the wait: a peer silent all along is named
        # as frozen, not timed out, when frozen_after is the timeout
        patience = max(self.timeout.total_seconds(), self.frozen_after_s + 2 * BEAT_S)
        deadline = time.monotonic() + patience
        while not self._done.acquire(timeout=BEAT_S):
            frozen = self._frozen(peers)
            if frozen is None and time.monotonic() < deadline:
                continue
            self._stuck = "an earlier wait never ended; the transport cannot be used again"
            if frozen is None:
                return False
            error = _silence(*frozen)
            report_origin(frozen[0], None, error.reason)  # the culprit, for every rank
            raise error
        outcome = self._outcome[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _wait_here(self, work: Work, peers: Sequence[int]) -> bool:
        """Wait for ``work`` on the caller's thread; once the timeout has ended it, name a
        peer of ``peers`` whose heartbeat then stands still for :data:`STILL_BEATS` beats."""
        start = time.monotonic()
        try:
            return work.wait(self.timeout)
        except RuntimeError:
            if time.monotonic() - start < self.timeout.total_seconds():
                raise  # a broken connection, which names its peer itself
            self._seen.clear()
            self._frozen(peers)  # the counters now
            time.sleep(STILL_BEATS * BEAT_S)
            frozen = self._frozen(peers, STILL_BEATS * BEAT_S)
            if frozen is None:
                raise
            self._stuck = "an earlier wait never ended; the transport cannot be used again"
            error = _silence(*frozen)
            report_origin(frozen[0], None, error.reason)
            raise error from None

    def _frozen(
        self, peers: Sequence[int], after_s: float | None = None
    ) -> tuple[int, float] | None:
        """The first of ``peers`` whose heartbeat has not moved for ``after_s`` (by
        default ``frozen_after``), and for how long; peers without a heartbeat (or whose
        key holds anything but a counter) are never frozen."""
        after_s = self.frozen_after_s if after_s is None else after_s
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
            if not (counter.isdigit() and len(counter) <= _COUNTER_DIGITS):
                self._seen.pop(peer, None)  # not a heartbeat's: judge nothing by it
                continue
            seen = self._seen.get(peer)
            if seen is None or seen[0] != counter:
                self._seen[peer] = (counter, now)
            elif now - seen[1] >= after_s:
                return peer, now - seen[1]
        return None


def _silence(peer: int, silent_s: float) -> PeerFrozen:
    """The error for ``peer``, silent for ``silent_s``: unreachable if this rank's own beats
    stopped reaching the store or the peer runs on another host; otherwise frozen, saying
    whether its process is stopped, hangs or has ended."""
    own_silence = time.monotonic() - _last_beat[0]
    if _beating is not None and own_silence >= min(silent_s, _OWN_SILENCE_S):
        return PeerUnreachable(
            peer,
            silent_s,
            f"rank {peer} is unreachable: neither its heartbeat nor this rank's has reached "
            f"the store for {min(silent_s, own_silence):.1f} s (this host's network is down)",
        )
    host, pid = _where(peer)
    if host is not None and host != socket.gethostname():
        return PeerUnreachable(
            peer,
            silent_s,
            f"rank {peer} on host {host} is unreachable: it has given no sign of life for "
            f"{silent_s:.1f} s (the network to that host is down, or the host hangs)",
        )
    state = _process_state(pid) if pid is not None else None
    how = {
        "stopped": "its process is stopped, by a signal or a debugger",
        "ended": "its process has ended",
        "running": "its process runs but its heartbeat does not: it hangs",
    }.get(state or "", "its process is stopped, by a signal or a debugger, or its machine hangs")
    return PeerFrozen(
        peer,
        silent_s,
        f"rank {peer} froze: it has given no sign of life for {silent_s:.1f} s ({how})",
    )


def _where(peer: int) -> tuple[str | None, int | None]:
    """The host and process id ``peer``'s heartbeat published (``None`` where unknown)."""
    store = _store()
    key = f"{_KEY}{peer}{_WHERE}"
    try:
        if store is None or not store.check([key]):
            return None, None
        host, _, pid = store.get(key).decode("utf-8", "replace").partition(" ")
    except RuntimeError:
        return None, None
    return host[:255] or None, int(pid) if pid.isdigit() and len(pid) < 10 else None


def _process_state(pid: int) -> str | None:
    """``stopped``, ``running`` or ``ended`` for process ``pid`` of this host (Linux);
    ``None`` where that cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "ended"
    except OSError:
        return None
    state = stat.rsplit(")", 1)[1].split()[0]
    return {"T": "stopped", "t": "stopped", "Z": "ended", "X": "ended"}.get(state, "running")
