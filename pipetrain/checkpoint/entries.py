"""The entries of a checkpoint: their keys, reading them with torch.distributed.checkpoint,
and the random-number states.

A checkpoint is one flat dictionary, saved with ``torch.distributed.checkpoint`` (DCP):

- ``model/NAME``: a parameter or buffer, by its name in the full model;
- ``optimizer/NAME/KEY``: the optimizer's state of parameter ``NAME`` (``exp_avg``, ``step``);
- ``optimizer_group/NAME``: the hyperparameters of the parameter group ``NAME`` was in;
- ``lr_scheduler``, ``precision``: the learning-rate scheduler's and the loss scaler's
  ``state_dict()``;
- ``rng/RANK``: the random-number states of global rank ``RANK``;
- ``progress``: ``{"step", "updates", "skipped_updates"}``;
- ``extra``: what the caller saved beside (such as the data position);
- ``layout``: how the saving pipeline was laid out (schedule, balance, ranks), for messages.

Objects other than tensors are pickled, so load only checkpoints you trust.
"""

from __future__ import annotations

import os
import random
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

MODEL = "model/"
OPTIMIZER = "optimizer/"
OPTIMIZER_GROUP = "optimizer_group/"
RNG = "rng/"
LR_SCHEDULER = "lr_scheduler"
PRECISION = "precision"
PROGRESS = "progress"
EXTRA = "extra"
LAYOUT = "layout"


class CheckpointMismatch(ValueError):
    """A checkpoint does not fit the model or optimizer it is loaded into; the message names
    each difference."""


def write(state: dict[str, Any], path: str | os.PathLike, group: dist.ProcessGroup | None) -> None:
    """Save this rank's ``state`` into ``path`` together with the other ranks' (every rank of
    ``group`` calls it; an entry that several ranks hold is written once)."""
    dcp.save(
        state,
        storage_writer=dcp.FileSystemWriter(path),
        planner=DefaultSavePlanner(flatten_state_dict=False),
        process_group=group,
    )


def read(
    state: dict[str, Any],
    path: str | os.PathLike,
    group: dist.ProcessGroup | None = None,
    *,
    distributed: bool = True,
) -> None:
    """Fill ``state``'s entries from the checkpoint at ``path``: tensors in place, other
    objects replaced. With ``distributed`` every rank of ``group`` calls it."""
    with warnings.catch_warnings():
        # DCP warns that it reads in one process, which is what distributed=False asks
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(
            state,
            storage_reader=dcp.FileSystemReader(path),
            planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            process_group=group,
            no_dist=not distributed,
        )


def contents(path: str | os.PathLike) -> dict[str, TensorStorageMetadata | None]:
    """Every key in the checkpoint at ``path``: a tensor's metadata (size and dtype), or
    ``None`` for another object."""
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {
        key: value if isinstance(value, TensorStorageMetadata) else None
        for key, value in metadata.items()
    }


def empty_like(entry: TensorStorageMetadata) -> torch.Tensor:
    """A CPU tensor to read a saved tensor into."""
    return torch.empty(entry.size, dtype=entry.properties.dtype)


def read_everything(path: str | os.PathLike) -> dict[str, Any]:
    """Every entry of the checkpoint at ``path``, read in this process alone."""
    found = contents(path)
    state: dict[str, Any] = {
        key: None if entry is None else empty_like(entry) for key, entry in found.items()
    }
    read(state, path, distributed=False)
    return state


def names(keys: Iterable[str], prefix: str) -> set[str]:
    """The names after ``prefix`` among ``keys``."""
    return {key[len(prefix) :] for key in keys if key.startswith(prefix)}


def model_differences(
    saved: Mapping[str, TensorStorageMetadata | None],
    held: Mapping[str, torch.Tensor],
    everywhere: set[str] | None = None,
) -> list[str]:
    """How the parameters and buffers ``held`` (by full-model name) differ from those in a
    checkpoint's contents ``saved``: names missing from it, different shapes, and (given
    ``everywhere``, every name the model has) saved names the model lacks."""
    problems = []
    for name, tensor in held.items():
        entry = saved.get(MODEL + name)
        if entry is None:
            problems.append(f"{name} is not in the checkpoint")
        elif tuple(entry.size) != tuple(tensor.shape):
            problems.append(
                f"{name} has shape {list(entry.size)} in the checkpoint but "
                f"{list(tensor.shape)} in the model"
            )
    if everywhere is not None:
        extra = sorted(names(saved, MODEL) - everywhere)
        if extra:
            problems.append(f"the checkpoint holds {', '.join(extra)}, which the model lacks")
    return problems


def refuse(problems: list[str], path: str | os.PathLike, limit: int = 8) -> None:
    """Raise :class:`CheckpointMismatch` listing ``problems`` (the first ``limit``), if any."""
    if not problems:
        return
    shown = problems[:limit]
    more = f"; and {len(problems) - limit} more" if len(problems) > limit else ""
    raise CheckpointMismatch(
        f"the checkpoint {path} does not fit: {'; '.join(shown)}{more} (is it of this model?)"
    )


def random_states() -> dict[str, Any]:
    """This process's random-number states: torch's CPU and CUDA ones, Python's, NumPy's."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def restore_random_states(states: Mapping[str, Any]) -> None:
    """Put back what :func:`random_states` returned."""
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
