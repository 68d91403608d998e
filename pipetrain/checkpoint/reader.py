"""Reading a checkpoint without running code from it.

torch.distributed.checkpoint (DCP) unpickles ``.metadata`` and every entry other than a
tensor without restriction (plain pickle, and ``torch.load`` with its weights-only check
off), either of which runs whatever code a crafted file names. :class:`CheckedReader`
reads ``.metadata`` through an unpickler that builds only DCP's own metadata types, torch
sizes, dtypes, layouts and memory formats, and plain containers, and reads only files the
checkpoint's manifest lists, once their checksums match; :class:`CheckedPlanner` reads the
other entries with ``torch.load(weights_only=True)``. Either way, each tensor's chunks
must cover it exactly and fit in the bytes stored for them, so no tensor keeps
uninitialised memory. ``trust=True`` restores DCP's own unpickling and skips the manifest.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from collections import OrderedDict
from pathlib import Path, PosixPath, PurePosixPath
from typing import IO, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

import pipetrain.checkpoint.manifest as manifest
from pipetrain.checkpoint.manifest import METADATA, CheckpointIntegrityError

_TORCH_CONSTANTS = {
    name
    for name, value in vars(torch).items()
    if isinstance(value, torch.dtype | torch.layout | torch.memory_format)
}
_ALLOWED: dict[tuple[str, str], Any] = {
    **{
        (dcp_metadata.__name__, kind.__name__): kind
        for kind in (
            Metadata,
            MetadataIndex,
            StorageMeta,
            TensorStorageMetadata,
            dcp_metadata.BytesStorageMetadata,
            dcp_metadata.ChunkStorageMetadata,
            dcp_metadata.TensorProperties,
            dcp_metadata._MEM_FORMAT_ENCODING,
        )
    },
    (filesystem.__name__, "_StorageInfo"): filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("collections", "OrderedDict"): OrderedDict,
    **{
        (module, kind.__name__): kind
        for module in ("pathlib", "pathlib._local")
        for kind in (PosixPath, PurePosixPath)
    },
    **{("builtins", kind.__name__): kind for kind in (set, frozenset, complex, bytearray)},
}
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


class UnsafeCheckpoint(ValueError):
    """A checkpoint holds an object that loading would have to run code to build; the
    message names the object and where it is."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata types, torch constants and plain containers, nothing else."""

    def __init__(self, file: IO[bytes], path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _TORCH_CONSTANTS:
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        raise UnsafeCheckpoint(
            f"{self.path} names {module}.{name}, which is not part of a checkpoint's metadata: "
            "loading it could run code; load it with trust=True only if you trust its source"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint(f"{self.path} holds a persistent reference, which no metadata has")


class CheckedReader(dcp.FileSystemReader):
    """A :class:`~torch.distributed.checkpoint.FileSystemReader` that checks what it reads:
    only files in the checkpoint's manifest with their checksums, and metadata holding
    nothing but DCP's own types (unless ``trust``)."""

    def __init__(self, path: str | os.PathLike, *, trust: bool = False) -> None:
        """Raises :class:`CheckpointIntegrityError` if (unless ``trust``) ``path`` has no
        valid manifest."""
        super().__init__(path)
        self.trust = trust
        self.manifest = None if trust else manifest.read(path)
        self.metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, read once (and checked).

        Raises:
            CheckpointIntegrityError: ``.metadata`` differs from the manifest, or refers to
                files it does not list, or its tensors' chunks do not fit their sizes.
            UnsafeCheckpoint: ``.metadata`` names anything else than the metadata's types.
        """
        if self.metadata is None:
            self.metadata = self._read_metadata()
        return self.metadata

    def _read_metadata(self) -> Metadata:
        if self.manifest is None:
            metadata = super().read_metadata()
        else:
            self.manifest.verify([METADATA])
            path = Path(self.path) / METADATA
            with open(path, "rb") as file:
                metadata = _MetadataUnpickler(file, path).load()
            if not isinstance(metadata, Metadata):
                raise UnsafeCheckpoint(f"{path} holds a {type(metadata).__name__}, not metadata")
            listed = set(self.manifest.files)
            for info in (metadata.storage_data or {}).values():
                if getattr(info, "relative_path", None) not in listed:
                    raise _damaged(self, f"{METADATA} refers to a file its manifest lacks")
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
        try:
            _check_chunks(self, metadata)
        except (TypeError, AttributeError, ValueError) as error:
            if isinstance(error, CheckpointIntegrityError):
                raise
            raise _damaged(self, f"its {METADATA} is malformed ({error})") from None
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read ``plan``'s items, once the files holding them match the manifest."""
        if self.manifest is not None:
            files = {self.storage_data[item.storage_index].relative_path for item in plan.items}
            self.manifest.verify(sorted(files))
        try:
            return super().read_data(plan, planner)
        except (AssertionError, RuntimeError) as error:  # DCP's and torch's checks of the data
            lines = str(error).strip().splitlines()
            found = lines[0] if lines else type(error).__name__
            raise _damaged(self, f"its data does not match its metadata ({found})") from None


class CheckedPlanner(DefaultLoadPlanner):
    """DCP's default load planner (nothing flattened), with entries other than tensors read
    by ``torch.load(weights_only=True)`` (unless ``trust``)."""

    def __init__(self, path: str | os.PathLike, *, trust: bool = False) -> None:
        """Plan a load from the checkpoint at ``path``."""
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.path, self.trust = path, trust

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Set the entry of ``read_item`` from its stored bytes.

        Raises:
            UnsafeCheckpoint: the entry names anything but tensors and plain containers.
        """
        if self.trust:
            super().load_bytes(read_item, value)
            return
        key = read_item.dest_index.fqn
        try:
            self.state_dict[key] = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            named = _GLOBAL.search(str(error))
            what = named.group(1) if named else str(error).splitlines()[0]
            raise UnsafeCheckpoint(
                f"the entry {key!r} of the checkpoint {self.path} names {what}, which loading "
                "it would run; load it with trust=True only if you trust its source"
            ) from None


def _check_chunks(reader: CheckedReader, metadata: Metadata) -> None:
    """Raise unless each tensor's chunks cover it exactly, each within the bytes stored."""
    storage = metadata.storage_data or {}
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        size = tuple(entry.size)
        if any(not isinstance(n, int) or n < 0 for n in size):
            raise _damaged(reader, f"{key} has the size {list(size)}")
        total = 0
        boxes = []
        for chunk in entry.chunks:
            start, length = tuple(chunk.offsets), tuple(chunk.sizes)
            if len(start) != len(size) or len(length) != len(size):
                raise _damaged(reader, f"a chunk of {key} has another rank than the tensor")
            if any(o < 0 or n < 0 or o + n > d for o, n, d in zip(start, length, size)):
                raise _damaged(reader, f"a chunk of {key} lies outside its size {list(size)}")
            volume = _product(length)
            info = storage.get(MetadataIndex(key, chunk.offsets))
            needed = volume * entry.properties.dtype.itemsize
            if not isinstance(info, filesystem._StorageInfo) or info.length < needed:
                raise _damaged(reader, f"{key} has fewer bytes stored than its size needs")
            total += volume
            boxes.append((start, length))
        if total != _product(size) or _overlapping(boxes):
            raise _damaged(reader, f"the chunks of {key} do not cover its size {list(size)}")


def _overlapping(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    return any(
        all(a < c + m and c < a + n for a, n, c, m in zip(*boxes[i], *boxes[j]))
        and _product(boxes[i][1]) > 0
        and _product(boxes[j][1]) > 0
        for i in range(len(boxes))
        for j in range(i)
    )


def _product(sizes: tuple[int, ...]) -> int:
    result = 1
    for n in sizes:
        result *= n
    return result


def _damaged(reader: CheckedReader, problem: str) -> CheckpointIntegrityError:
    return CheckpointIntegrityError(f"the checkpoint {reader.path} is damaged: {problem}")
