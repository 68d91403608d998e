"""A checkpoint's manifest: every file's size and SHA-256, written last.

A save writes ``manifest.json`` into its temporary directory after every rank's data and
DCP's ``.metadata``, and only then renames the directory: a checkpoint is complete when its
manifest says so and every file it lists is there at its size (:meth:`Manifest.check_sizes`,
cheap), and intact when every file's checksum matches too (:meth:`Manifest.verify`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
METADATA = ".metadata"  # written by torch.distributed.checkpoint once every rank has written
_FORMAT = 1
_MAX_BYTES = 16 * 2**20
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 2**20


class CheckpointIntegrityError(ValueError):
    """A checkpoint is incomplete or damaged, or has no manifest to check it by; the message
    names the checkpoint, the file and the problem."""


@dataclass(frozen=True)
class Manifest:
    """The files of the checkpoint in ``directory``: name → (size in bytes, SHA-256)."""

    directory: Path
    files: dict[str, tuple[int, str]]

    def check_sizes(self) -> None:
        """Raise :class:`CheckpointIntegrityError` unless every file is there at its size."""
        for name in self.files:
            self._check_size(name)

    def verify(self, names: list[str] | None = None) -> None:
        """Raise :class:`CheckpointIntegrityError` unless the files ``names`` (by default
        all) are listed, there at their sizes, and hash to their checksums."""
        for name in self.files if names is None else names:
            self._check_size(name)
            path = self.directory / name
            status = path.stat()
            found = _sha256(str(path), status.st_ino, status.st_size, status.st_mtime_ns)
            if found != self.files[name][1]:
                raise _damaged(self.directory, f"{name}'s checksum differs from the manifest's")

    def _check_size(self, name: str) -> None:
        if name not in self.files:
            raise _damaged(self.directory, f"{name} is not in its manifest")
        try:
            size = (self.directory / name).stat().st_size
        except FileNotFoundError:
            raise _damaged(self.directory, f"{name} is missing") from None
        if size != self.files[name][0]:
            raise _damaged(
                self.directory, f"{name} is {size} bytes, its manifest says {self.files[name][0]}"
            )


def write(directory: str | os.PathLike) -> None:
    """Record every file in ``directory`` in its manifest, made durable before returning.

    Raises:
        CheckpointIntegrityError: ``directory`` lacks DCP's ``.metadata``.
    """
    base = Path(directory)
    if not (base / METADATA).is_file():
        raise _damaged(base, f"{METADATA} is missing: the save did not finish")
    files = {}
    for path in sorted(base.iterdir()):
        if path.is_file() and path.name != MANIFEST:
            status = path.stat()
            digest = _sha256(str(path), status.st_ino, status.st_size, status.st_mtime_ns)
            files[path.name] = {"size": status.st_size, "sha256": digest}
    written = base / f"{MANIFEST}.tmp"
    with open(written, "w", encoding="utf-8") as file:
        file.write(json.dumps({"format_version": _FORMAT, "files": files}, indent=1))
        file.flush()
        os.fsync(file.fileno())
    os.replace(written, base / MANIFEST)


def read(directory: str | os.PathLike) -> Manifest:
    """The manifest of the checkpoint in ``directory``.

    Raises:
        CheckpointIntegrityError: there is none, or it is not a manifest.
    """
    base = Path(directory)
    path = base / MANIFEST
    try:
        with open(path, "rb") as file:
            text = file.read(_MAX_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointIntegrityError(
            f"the checkpoint {base} has no {MANIFEST}: it was saved by an older pipetrain, "
            "or its save did not finish; load it with trust=True (pipetrain export --trust) "
            "if you trust it"
        ) from None
    if len(text) > _MAX_BYTES:
        raise _damaged(base, f"{MANIFEST} is over {_MAX_BYTES} bytes")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise _damaged(base, f"{MANIFEST} is not JSON ({error})") from None
    return Manifest(base, _files(base, data))


def _files(base: Path, data: Any) -> dict[str, tuple[int, str]]:
    """The manifest's files, once ``data`` is known to be a manifest."""
    if not isinstance(data, dict) or data.get("format_version") != _FORMAT:
        raise _damaged(base, f"{MANIFEST} is not a format-{_FORMAT} manifest")
    listed = data.get("files")
    if not isinstance(listed, dict) or METADATA not in listed:
        raise _damaged(base, f"{MANIFEST} does not list {METADATA}")
    files = {}
    for name, entry in listed.items():
        plain = name not in ("", ".", "..", MANIFEST) and "/" not in name and "\\" not in name
        size = entry.get("size") if isinstance(entry, dict) else None
        digest = entry.get("sha256") if isinstance(entry, dict) else None
        if (
            not plain
            or not isinstance(size, int)
            or isinstance(size, bool)
            or size < 0
            or not isinstance(digest, str)
            or not _SHA256.fullmatch(digest)
        ):
            raise _damaged(base, f"{MANIFEST} has a malformed entry {name!r}")
        files[name] = (size, digest)
    return files


@lru_cache(maxsize=4096)
def _sha256(path: str, inode: int, size: int, modified_ns: int) -> str:
    """The SHA-256 of the file at ``path``, computed once for each (inode, size, mtime)."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _damaged(directory: Path, problem: str) -> CheckpointIntegrityError:
    return CheckpointIntegrityError(f"the checkpoint {directory} is damaged: {problem}")
