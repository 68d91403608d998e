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
"""

from __future__ import annotations

import ctypes
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
