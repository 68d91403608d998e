"""Where a stage's initial weights come from: a state dict, a ``.safetensors`` file or a
``torch.save``d state dict, read by full-model name one entry at a time.

A file is opened without reading it whole: safetensors reads each asked entry from the
file, and a ``torch.save`` file is memory-mapped, so a stage touches only its own entries.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

WeightsArg = Mapping[str, Tensor] | str | os.PathLike
"""A state dict keyed by full-model names, or the path of a file holding one."""

_TORCH_SUFFIXES = (".pt", ".pth", ".bin")


@dataclass(frozen=True)
class WeightSource:
    """An open source of weights: its ``keys``, an entry by name, and how to name it."""

    label: str
    keys: frozenset[str]
    read: Callable[[str], Tensor]


@contextmanager
def open_weights(weights: WeightsArg) -> Iterator[WeightSource]:
    """Open ``weights`` (a state dict or a file's path) for reading entries by name.

    Raises:
        FileNotFoundError: a path that is not a file.
        ValueError: a file of an unknown kind, or one that holds no state dict.
    """
    if isinstance(weights, Mapping):
        yield WeightSource("the weights state dict", frozenset(weights), weights.__getitem__)
        return
    path = Path(weights)
    label = f"weights file {str(path)!r}"
    if not path.is_file():
        raise FileNotFoundError(f"{label} does not exist")
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
