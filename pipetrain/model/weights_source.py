"""Where a stage's initial weights come from: a state dict, a ``.safetensors`` file, a
``torch.save``d state dict, a sharded checkpoint's index (``model.safetensors.index.json``)
or a ``save_pretrained`` directory holding one of those, read by full-model name one entry
at a time.

A file is opened without reading it whole: safetensors reads each asked entry from the
file, and a ``torch.save`` file is memory-mapped, so a stage touches only its own entries;
of a sharded checkpoint only the shards holding them are opened.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

WeightsArg = Mapping[str, Tensor] | str | os.PathLike
"""A state dict keyed by full-model names, or the path of a file, sharded checkpoint index
or ``save_pretrained`` directory holding one."""

_TORCH_SUFFIXES = (".pt", ".pth", ".bin")
_INDEX_SUFFIX = ".index.json"
# what save_pretrained writes, in the order a directory is searched
_DIRECTORY_FILES = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)


@dataclass(frozen=True)
class WeightSource:
    """An open source of weights: its ``keys``, an entry by name, and how to name it."""

    label: str
    keys: frozenset[str]
    read: Callable[[str], Tensor]


@contextmanager
def open_weights(weights: WeightsArg) -> Iterator[WeightSource]:
    """Open ``weights`` (a state dict, a file's path, a sharded checkpoint's
    ``*.index.json`` or a directory holding one of :data:`_DIRECTORY_FILES`) for reading
    entries by name.

    Raises:
        FileNotFoundError: a path that does not exist, or a directory without weights.
        ValueError: a file of an unknown kind, or one that holds no state dict.
    """
    if isinstance(weights, Mapping):
        yield WeightSource("the weights state dict", frozenset(weights), weights.__getitem__)
        return
    path = _weights_file(Path(weights))
    if path.name.endswith(_INDEX_SUFFIX):
        with _sharded(path) as source:
            yield source
        return
    with _single(path) as source:
        yield source


def _weights_file(path: Path) -> Path:
    """``path``, or the weights file a ``save_pretrained`` directory at ``path`` holds."""
    if path.is_dir():
        for name in _DIRECTORY_FILES:
            if (path / name).is_file():
                return path / name
        raise FileNotFoundError(
            f"weights directory {str(path)!r} holds none of {', '.join(_DIRECTORY_FILES)}; "
            "give the weights file itself, or the directory save_pretrained() wrote"
        )
    if not path.is_file():
        raise FileNotFoundError(f"weights file {str(path)!r} does not exist")
    return path


@contextmanager
def _sharded(index: Path) -> Iterator[WeightSource]:
    """A sharded checkpoint through its index: each entry read from its shard, and a
    shard opened the first time one of its entries is read."""
    label = f"sharded weights {str(index)!r}"
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{label} is not a checkpoint index (a JSON object with a 'weight_map' of entry "
            f"names to shard files): {error}"
        ) from error
    opened: dict[str, WeightSource] = {}
    with ExitStack() as stack:

        def read(name: str) -> Tensor:
            shard = weight_map[name]
            if shard not in opened:
                shard_path = index.parent / shard
                if not shard_path.is_file() or shard_path.parent != index.parent:
                    raise FileNotFoundError(
                        f"{label} puts {name!r} in {shard!r}, which is not a file beside it"
                    )
                opened[shard] = stack.enter_context(_single(shard_path))
            return opened[shard].read(name)

        yield WeightSource(label, frozenset(weight_map), read)


@contextmanager
def _single(path: Path) -> Iterator[WeightSource]:
    """One weights file."""
    label = f"weights file {str(path)!r}"
    if path.suffix == ".safetensors":
        try:
            from safetensors import safe_open
        except ImportError as error:
            raise ImportError(
                f"reading {label} needs the safetensors package: pip install safetensors"
            ) from error

        with safe_open(str(path), framework="pt", device="cpu") as file:
            yield WeightSource(label, frozenset(file.keys()), file.get_tensor)
        return
    if path.suffix in _TORCH_SUFFIXES:
        state = _torch_state(path)
        yield WeightSource(label, frozenset(state), state.__getitem__)
        return
    raise ValueError(
        f"{label} is neither a .safetensors file nor a torch.save file "
        f"({', '.join(_TORCH_SUFFIXES)}); save the model's state_dict() as one of those"
    )


def _torch_state(path: Path) -> Mapping[str, Tensor]:
    """A ``torch.save``d state dict, memory-mapped so that only the entries read are loaded."""
    state: Any = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(
            f"weights file {str(path)!r} holds a {type(state).__name__}, not a state dict of "
            "tensors; save model.state_dict() itself (not a dict around it)"
        )
    return state
