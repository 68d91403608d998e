"""A training process's freed memory kept for its next step instead of handed back.

By default glibc's ``free`` gives the top of the heap back to the kernel once more than its
trim threshold is free there, and serves an allocation of more than its mmap threshold
(which it raises, up to 32 MiB, as it sees them freed) with a fresh mapping. A training
step frees most of what it allocates (activations, gradients, the optimizer's temporaries)
and allocates the same again in the next step, so each step faults its memory back in,
page by page, and the kernel zeroes every page. On an emulated cluster's VGG, the stage
holding the fully connected layers took 60,000 page faults a second, 8 ms of kernel time
in a 74 ms step; kept, they fell to none and the step to 67 ms
(``benchmarks/README.md``, "Freed memory kept").

A process whose memory must follow what it holds (a worker of a host-stored schedule,
whose stages' working copies come and go) hands the free pages back where they pile up:
:func:`return_freed_memory`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameters (``malloc.h``)."""

KEPT_BYTES = 2**31 - 1
"""Free memory at the top of the heap that ``free`` keeps: the most ``mallopt`` takes (an
int), which in effect is all of it."""

MAPPED_FROM_BYTES = 32 * 2**20
"""Allocations from this size up get a mapping of their own: glibc's ceiling for the
threshold, which its default policy reaches only after it has seen such blocks freed."""


FREE_KEPT_BYTES = 16 * 2**20
"""Free memory :func:`return_freed_memory` leaves with the allocator for reuse: what is
handed back is faulted in again, page by page, when it is next allocated."""


class _MallocInfo(ctypes.Structure):
    """glibc's ``struct mallinfo2``."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc with ``malloc_trim`` and ``mallinfo2`` (2.33+)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        libc.mallinfo2.argtypes, libc.mallinfo2.restype = [], _MallocInfo
    except (OSError, AttributeError, TypeError):
        return None
    return libc


_GLIBC = _glibc()


def return_freed_memory(kept: int = FREE_KEPT_BYTES) -> bool:
    """Where the allocator holds more than ``kept`` bytes free, give their pages back to
    the system (glibc's ``malloc_trim``); whether it did (never where the C library is not
    glibc 2.33 or newer)."""
    if _GLIBC is None or _GLIBC.mallinfo2().fordblks <= kept:
        return False
    _GLIBC.malloc_trim(0)
    return True


def keep_freed_memory() -> bool:
    """Make glibc's allocator keep the memory this process frees for reuse (its trim
    threshold raised to the most it takes, its mmap threshold fixed at its 32 MiB ceiling)
    and return whether it took both settings; where the C library is not glibc, nothing
    changes and it returns ``False``. The process's resident memory then stays near its
    peak between steps instead of falling and being faulted back in; blocks of 32 MiB and
    more are still mapped and unmapped each time."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success, 0 on a value it refuses
    return bool(mallopt(M_TRIM_THRESHOLD, KEPT_BYTES)) and bool(
        mallopt(M_MMAP_THRESHOLD, MAPPED_FROM_BYTES)
    )
