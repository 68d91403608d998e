"""Failures of torch.distributed.checkpoint told in one line.

DCP gathers every rank's exception into a ``CheckpointException``, a ``BaseException``
whose text is each rank's whole traceback. :func:`saving_error` and :func:`loading_error`
turn one into an ordinary exception naming the checkpoint, the rank where it began and the
problem; storage errors (a full disk, a read-only file system, no permission) are named for
what they are.
"""

from __future__ import annotations

import errno
import os
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from pipetrain.checkpoint.manifest import CheckpointIntegrityError
from pipetrain.checkpoint.reader import UnsafeCheckpoint

_STORAGE = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}


def saving_error(failure: BaseException, path: str | os.PathLike) -> RuntimeError:
    """One line for ``failure``, raised while writing the checkpoint at ``path``."""
    rank, cause = _origin(failure)
    where = "" if rank is None else f" on rank {rank}"
    storage = _storage_error(cause)
    if storage is not None:
        name = errno.errorcode.get(storage.errno or 0, "")
        return RuntimeError(
            f"could not write the checkpoint {path}{where}: {_STORAGE[storage.errno or 0]} "
            f"({name}, writing {storage.filename or path}); the unfinished checkpoint was removed"
        )
    return RuntimeError(f"saving the checkpoint {path} failed{where}: {_one_line(cause)}")


def loading_error(failure: BaseException, path: str | os.PathLike) -> BaseException:
    """What to raise for ``failure``, raised while reading the checkpoint at ``path``: a
    refusal of a damaged or unsafe checkpoint as it was raised, anything else in one line."""
    rank, cause = _origin(failure)
    if isinstance(cause, CheckpointIntegrityError | UnsafeCheckpoint):
        return cause
    where = "" if rank is None else f" on rank {rank}"
    return RuntimeError(f"reading the checkpoint {path} failed{where}: {_one_line(cause)}")


def _origin(failure: BaseException) -> tuple[int | None, BaseException]:
    """The rank where ``failure`` began (the lowest failing one) and its exception."""
    if not isinstance(failure, CheckpointException) or not failure.failures:
        return None, failure
    rank = min(failure.failures)
    wrapped: Any = failure.failures[rank]
    return rank, wrapped[0] if isinstance(wrapped, tuple) else wrapped


def _storage_error(error: BaseException | None) -> OSError | None:
    """The storage error among ``error`` and its causes, if any."""
    seen = 0
    while error is not None and seen < 16:
        if isinstance(error, OSError) and error.errno in _STORAGE:
            return error
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"
