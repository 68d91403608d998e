"""Workers never outlive the process that started them.

:func:`end_with_parent` is for the local launcher's workers: on Linux the kernel kills the
worker the moment the launcher dies (``PR_SET_PDEATHSIG``), elsewhere a thread looks every
quarter of a second. :func:`end_with_agent` is for workers that ``torchrun``'s agent
started: a SIGKILLed agent leaves its workers training on (their connections to each other
stay up) and writing checkpoints that a restarted job then shares; with it, a worker whose
agent is gone ends at once (Linux: a thread waits on a descriptor of the agent's process,
which the kernel marks ready when it ends; elsewhere within a quarter of a second), before
it writes another checkpoint. :func:`exit_now` ends a worker once its work is done.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import select
import signal
import sys
import threading
import time
from contextlib import suppress
from typing import NoReturn

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_POLL_S = 0.25
AGENT_ENV = "TORCHELASTIC_RUN_ID"  # set by torchrun's agent in every worker it starts


def _watch(parent: int) -> None:
    """End this process, at once and without cleanup, when ``parent`` is no longer its
    parent (it died, and the process was handed to another)."""

    def watch() -> None:
        ended = _process_descriptor(parent)
        while os.getppid() == parent:
            if ended is None:
                time.sleep(PARENT_POLL_S)
            else:  # no wake-ups while the parent lives; at once when it ends
                select.select([ended], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="pipetrain-parent-watch", daemon=True).start()


def _process_descriptor(pid: int) -> int | None:
    """A descriptor that becomes readable when process ``pid`` ends (Linux 5.3 and later), or
    ``None`` where the system has none to give."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux, an old kernel, or the process is gone
        return None


def end_with_parent(parent: int) -> None:
    """End this process when process ``parent`` (the launcher) ends, however it ends."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    else:
        _watch(parent)
    if os.getppid() != parent:  # the launcher died before the watch began
        os._exit(1)


_watched: list[int] = []  # the agent watched for, once per process


def end_with_agent() -> None:
    """Under ``torchrun``: end this worker when its agent (its parent process) dies, even by
    SIGKILL. A thread waits for the agent's process to end (or, without a process
    descriptor, looks every :data:`PARENT_POLL_S`), rather than the kernel's parent-death
    signal: the agent may start workers from any of its threads, whose end that signal
    would take for the agent's. Elsewhere, and when called again, nothing happens."""
    if AGENT_ENV not in os.environ or _watched:
        return
    _watched.append(os.getppid())
    _watch(_watched[0])


def exit_now(status: int) -> NoReturn:
    """End this worker process with ``status``: run its exit handlers and flush its output,
    then exit without finalizing the interpreter.

    A gloo process group's worker thread lets go of a finished collective's tensors just
    after the caller's wait returns, and letting go of a tensor takes the GIL. If the
    interpreter has begun to finalize by then (a rank whose last collective was the one
    just waited for ends at once), taking the GIL ends that thread by a forced unwind that
    aborts the process with SIGABRT ("terminate called without an active exception"), and
    torchrun reports a finished job as failed. ``destroy_process_group`` leaves those
    threads running while the group's object is still referred to (as it was after a
    sharded run), so the process ends here with its threads, the interpreter alive."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):  # a closed or broken stream has nothing to flush
            stream.flush()
    os._exit(status)
