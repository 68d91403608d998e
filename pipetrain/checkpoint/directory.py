"""Where checkpoints live: one directory per saved step under a root, made atomically.

A save writes ``ROOT/.step-00000012.tmp`` and, once every rank has finished writing, renames
it to ``ROOT/step-00000012``: a directory with the final name is always complete, and a
save that dies half-way leaves only a temporary directory, which :func:`latest` ignores and
the next save removes. Every rank must see the same ``ROOT`` (one machine, or a shared file
system).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

_STEP = re.compile(r"step-(\d+)")
_TEMPORARY = re.compile(r"\.step-\d+(\.old)?\.tmp")
METADATA = ".metadata"  # written by torch.distributed.checkpoint once every rank has written


def step_path(root: str | os.PathLike, step: int) -> Path:
    """The directory of ``step``'s checkpoint under ``root``."""
    return Path(root) / f"step-{step:08d}"


def temporary_path(root: str | os.PathLike, step: int) -> Path:
    """Where ``step``'s checkpoint is written before it is complete."""
    return Path(root) / f".step-{step:08d}.tmp"


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a complete checkpoint directory."""
    return (Path(path) / METADATA).is_file()


def step_of(path: str | os.PathLike) -> int:
    """The step a checkpoint directory was saved at, from its name."""
    match = _STEP.fullmatch(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not a checkpoint directory (named step-NNNNNNNN)")
    return int(match.group(1))


def checkpoints(root: str | os.PathLike) -> list[Path]:
    """The complete checkpoints under ``root``, oldest first (none if it does not exist)."""
    base = Path(root)
    if not base.is_dir():
        return []
    found = [p for p in base.iterdir() if _STEP.fullmatch(p.name) and is_checkpoint(p)]
    return sorted(found, key=step_of)


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root``; ``None`` if there is none."""
    found = checkpoints(root)
    return found[-1] if found else None


def resolve(path: str | os.PathLike) -> Path:
    """``path`` itself if it is a checkpoint, else the newest complete one under it.

    Raises:
        FileNotFoundError: neither holds a complete checkpoint.
    """
    if is_checkpoint(path):
        return Path(path)
    newest = latest(path)
    if newest is None:
        raise FileNotFoundError(f"no complete checkpoint in {path}")
    return newest


def clear_temporary(root: str | os.PathLike) -> None:
    """Create ``root`` if needed and remove what unfinished saves left there."""
    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    for path in base.iterdir():
        if _TEMPORARY.fullmatch(path.name):
            shutil.rmtree(path, ignore_errors=True)


def commit(root: str | os.PathLike, step: int) -> Path:
    """Give ``step``'s finished temporary directory its final name (replacing an older save
    of the same step) and return it."""
    final, written = step_path(root, step), temporary_path(root, step)
    if final.exists():
        old = final.with_name(f".{final.name}.old.tmp")
        os.replace(final, old)
        os.replace(written, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(written, final)
    _sync_directory(Path(root))
    return final


def prune(root: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints; return those deleted."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    old = checkpoints(root)[:-keep]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old


def _sync_directory(path: Path) -> None:
    """Make a rename in ``path`` durable (where the platform allows opening a directory)."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)
