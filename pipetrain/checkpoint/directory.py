"""Where checkpoints live: one directory per saved step under a root, made atomically.

A save writes ``ROOT/.step-00000012.TOKEN.tmp`` (``TOKEN`` the saving run's, from its lock
on ``ROOT``: see :mod:`pipetrain.checkpoint.lock`) and, once every rank has finished
writing, records every file's size and checksum in its manifest
(:mod:`pipetrain.checkpoint.manifest`) and renames it to ``ROOT/step-00000012``. A
checkpoint is complete when its manifest says so: a save that dies half-way leaves only a
temporary directory, which :func:`latest` ignores and the next save removes, and
:func:`resolve` passes over a damaged checkpoint to the newest intact one. Every rank must
see the same ``ROOT`` (one machine, or a shared file system).
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path

import pipetrain.checkpoint.lock as lock
import pipetrain.checkpoint.manifest as manifest
from pipetrain.checkpoint.manifest import MANIFEST, METADATA, CheckpointIntegrityError

_STEP = re.compile(r"step-(\d+)")
_TEMPORARY = re.compile(r"\.step-\d+(\.[\w-]+)?(\.old)?\.tmp")


def step_path(root: str | os.PathLike, step: int) -> Path:
    """The directory of ``step``'s checkpoint under ``root``."""
    return Path(root) / f"step-{step:08d}"


def temporary_path(root: str | os.PathLike, step: int) -> Path:
    """Where the run holding ``root``'s lock writes ``step``'s checkpoint before it is
    complete."""
    token = lock.token(root)
    return Path(root) / (
        f".step-{step:08d}.tmp" if token is None else f".step-{step:08d}.{token}.tmp"
    )


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a complete checkpoint directory: its manifest lists files that
    are all there at their sizes (their checksums are checked when loading)."""
    try:
        manifest.read(path).check_sizes()
    except CheckpointIntegrityError:
        return False
    return True


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


def resolve(path: str | os.PathLike, *, trust: bool = False) -> Path:
    """``path`` itself if it is a checkpoint, else the newest intact one under it; a newer
    checkpoint that is incomplete or damaged is passed over with a warning saying why.

    With ``trust``, a checkpoint is any directory holding DCP's ``.metadata`` (as older
    pipetrain saved them, without a manifest) and nothing is checked.

    Raises:
        CheckpointIntegrityError: ``path`` is a checkpoint, and is incomplete or damaged.
        FileNotFoundError: neither holds an intact checkpoint.
    """
    base = Path(path)
    if (base / MANIFEST).is_file() or (base / METADATA).is_file():
        if not trust:
            manifest.read(base).verify()
        return base
    found = sorted(
        (p for p in base.iterdir() if _STEP.fullmatch(p.name)) if base.is_dir() else [],
        key=step_of,
        reverse=True,
    )
    skipped = []
    for candidate in found:
        if trust:
            if (candidate / METADATA).is_file():
                return candidate
            continue
        try:
            manifest.read(candidate).verify()
        except CheckpointIntegrityError as problem:
            warnings.warn(f"skipping {candidate.name}: {problem}", stacklevel=2)
            skipped.append(f"{candidate.name} ({problem})")
            continue
        return candidate
    passed = f"; passed over {'; '.join(skipped[:3])}" if skipped else ""
    more = f"; and {len(skipped) - 3} more" if len(skipped) > 3 else ""
    raise FileNotFoundError(f"no complete checkpoint in {path}{passed}{more}")


def clear_temporary(root: str | os.PathLike) -> None:
    """Create ``root`` if needed, take its lock for this run, and remove what unfinished
    saves left there.

    Raises:
        DirectoryLocked: another live run holds the lock.
    """
    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    lock.acquire(base)
    for path in base.iterdir():
        if _TEMPORARY.fullmatch(path.name):
            shutil.rmtree(path, ignore_errors=True)


def commit(root: str | os.PathLike, step: int) -> Path:
    """Record ``step``'s finished temporary directory in its manifest, then give it its final
    name (replacing an older save of the same step) and return it; if that fails, the
    temporary directory is removed."""
    final, written = step_path(root, step), temporary_path(root, step)
    try:
        manifest.write(written)
    except (OSError, CheckpointIntegrityError):
        shutil.rmtree(written, ignore_errors=True)
        raise
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
    """Delete all but the ``keep`` newest complete checkpoints, each's manifest first (so a
    prune that dies half-way leaves no directory that looks complete); return those
    deleted."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    old = checkpoints(root)[:-keep]
    for path in old:
        (path / MANIFEST).unlink(missing_ok=True)
        _sync_directory(path)
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
