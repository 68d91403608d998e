"""gloo's I/O threads made to wait for a core instead of taking one from the computation.

gloo's TCP transport moves bytes on one event-loop thread per device (``gloo_tcp_loop``).
Its handler only *tries* to lock a connection, and its epoll is level-triggered, so when
it is woken while the process's own thread holds that lock (posting a send or a receive),
it spins until the lock is free. Woken on the core where that thread runs, it takes the
core from it and spins there until the scheduler's next tick: round trips of a few bytes
between processes that share two cores took a whole tick (4.0 ms at 250 Hz) for runs of
dozens at a time, against 0.1-0.5 ms otherwise. A thread marked ``SCHED_BATCH`` does not
take a running thread's core when it is woken: it runs at once on an idle core, or when
the running thread blocks (as a thread waiting for a message soon does), or at the tick.
The thread is found by its name, which the gloo of torch 2.13 gives it; torch 2.11's
leaves it unnamed, and there nothing is marked.
"""

from __future__ import annotations

import os
from contextlib import suppress

LOOP_THREAD = "gloo_tcp_loop"


def loop_threads() -> list[int]:
    """The thread ids of this process's gloo event-loop threads (none where ``/proc`` is
    missing or gloo leaves them unnamed)."""
    if not os.path.isdir("/proc/self/task"):
        return []
    found = []
    for thread in os.listdir("/proc/self/task"):
        # a thread may end between the listing and the read: skip it
        with suppress(OSError), open(f"/proc/self/task/{thread}/comm") as name:
            if name.read().strip() == LOOP_THREAD:
                found.append(int(thread))
    return found


def defer_gloo_io_threads() -> int:
    """Mark every gloo event-loop thread of this process ``SCHED_BATCH`` (Linux; elsewhere
    nothing changes) and return how many were marked. Call it after creating a gloo process
    group, whose devices start new threads; threads marked before are marked again."""
    setter = getattr(os, "sched_setscheduler", None)
    if setter is None:
        return 0
    marked = 0
    for thread in loop_threads():
        with suppress(OSError):  # the thread ended since it was found
            setter(thread, os.SCHED_BATCH, os.sched_param(0))
            marked += 1
    return marked
