"""A host weight store: regions of shared memory mapped into this process as tensors.

A schedule whose weights live in a host store (``roundpipe``) keeps each stage's
parameters, their gradients and the optimizer's state outside the worker's private memory
(see :mod:`~pipetrain.runtime.rank.stored_stage`). Each region is a file in ``/dev/shm``
(tmpfs: memory, not disk; the system's temporary directory where there is none) mapped
shared and seen as a tensor of bytes. Its space is reserved when it is made
(``posix_fallocate``), so a full ``/dev/shm`` (64 MiB in a default container) is found
then, and the region made in the temporary directory instead, never met as a SIGBUS on a
later write. The file is unlinked as soon as it is mapped: the memory lives as long as the
mapping, and a worker that dies, even by SIGKILL, leaves no file behind.
:meth:`Region.release` drops the region's pages from the process's resident set
(``MADV_DONTNEED`` on a shared file mapping keeps the data in the file), so a worker's RSS
holds only what it has touched since.

A worker's working copies and gradients come and go with every ``LOAD`` and ``OFFLOAD``,
and a training process's allocator keeps what it frees (:mod:`pipetrain.distributed.heap`),
so the resident set would grow to the stages' high-water mark and stay: the stored stages
hand the free pages back after each ``OFFLOAD`` and each part of an optimizer step
(:func:`~pipetrain.distributed.heap.return_freed_memory`).

On a GPU the regions would be pinned (``cudaHostRegister`` of :attr:`Region.bytes`'s
pointer) so that copies to and from the device run asynchronously on a stream of their own.
"""

from __future__ import annotations

import errno
import mmap
import os
import tempfile

import torch

SHARED_MEMORY = "/dev/shm"
ALIGNMENT = 64  # bytes: every tensor in a region starts on a cache line


def store_directory() -> str | None:
    """Where regions are made: ``/dev/shm`` where it is a writable directory, else
    ``None`` (the system's temporary directory)."""
    if os.path.isdir(SHARED_MEMORY) and os.access(SHARED_MEMORY, os.W_OK):
        return SHARED_MEMORY
    return None


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to :data:`ALIGNMENT`."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


class Region:
    """``nbytes`` of zeroed shared memory mapped into this process (``name`` says what it
    holds in the file's name, which no other region's collides with)."""

    def __init__(self, name: str, nbytes: int) -> None:
        """Make and map the region; its file is unlinked at once."""
        size = max(aligned(nbytes), ALIGNMENT)  # a mapping cannot be empty
        prefix = f"pipetrain-store-{os.getpid()}-{name}-"
        directory = store_directory()
        try:
            self._map = _mapped(prefix, size, directory)
        except OSError as error:
            if directory is None or error.errno != errno.ENOSPC:
                raise
            self._map = _mapped(prefix, size, None)  # shared memory is full: on disk
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        """The region as one tensor of bytes."""

    def view(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        """The region's bytes from ``offset`` as a tensor of ``like``'s shape and dtype."""
        nbytes = like.numel() * like.element_size()
        flat = self.bytes[offset : offset + nbytes].view(like.dtype)
        return flat.view(like.shape)

    def release(self, offset: int = 0, nbytes: int | None = None) -> None:
        """Drop the region's pages (those holding ``nbytes`` from ``offset``, where given)
        from this process's resident set; the data stays."""
        if nbytes is None:
            self._map.madvise(mmap.MADV_DONTNEED)
            return
        start = offset - offset % mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, start, offset + nbytes - start)


def _mapped(prefix: str, size: int, directory: str | None) -> mmap.mmap:
    """A new file of ``size`` reserved bytes in ``directory``, mapped shared, unlinked."""
    descriptor, path = tempfile.mkstemp(prefix=prefix, dir=directory)
    try:
        os.posix_fallocate(descriptor, 0, size)
        return mmap.mmap(descriptor, size, mmap.MAP_SHARED)
    finally:
        os.close(descriptor)
        os.unlink(path)


def resident_bytes() -> int:
    """This process's resident set size (``VmRSS``), in bytes; 0 where ``/proc`` has none."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
