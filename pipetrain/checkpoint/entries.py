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
- ``extra``: what the caller saved beside (such as the data position): dicts, lists,
  tuples, strings, numbers, booleans, ``None`` and tensors;
- ``layout``: how the saving pipeline was laid out (schedule, balance, ranks), for messages.

Every entry other than a tensor is made of plain containers, numbers, strings and tensors,
so it loads with ``torch.load(weights_only=True)``; reading goes through
:mod:`pipetrain.checkpoint.reader`, which runs no code from the checkpoint unless ``trust``.
"""

from __future__ import annotations

import os
import random
import shutil
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from pipetrain.checkpoint.failures import loading_error, saving_error
from pipetrain.checkpoint.reader import CheckedPlanner, CheckedReader

MODEL = "model/"
OPTIMIZER = "optimizer/"
OPTIMIZER_GROUP = "optimizer_group/"
RNG = "rng/"
LR_SCHEDULER = "lr_scheduler"
PRECISION = "precision"
PROGRESS = "progress"
EXTRA = "extra"
LAYOUT = "layout"
_EXTRA_DEPTH = 64


class CheckpointMismatch(ValueError):
    """A checkpoint does not fit the model or optimizer it is loaded into; the message names
    each difference."""


def write(state: dict[str, Any], path: str | os.PathLike, group: dist.ProcessGroup | None) -> None:
    """Save this rank's ``state`` into ``path`` together with the other ranks' (every rank of
    ``group`` calls it; an entry that several ranks hold is written once).

    Raises:
        ValueError: on every rank, if a rank's ``extra`` entry holds another kind of object
            than :func:`extra_problem` allows.
        RuntimeError: on every rank, in one line naming the path and the rank, if a rank
            could not write (such as a full disk); ``path`` is removed.
    """
    _agree(extra_problem(state[EXTRA]) if EXTRA in state else None, group)
    try:
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(path),
            planner=DefaultSavePlanner(flatten_state_dict=False),
            process_group=group,
        )
    except (CheckpointException, OSError) as failure:
        shutil.rmtree(path, ignore_errors=True)
        raise saving_error(failure, path) from None


def extra_problem(value: Any, where: str = "extra", depth: int = 0) -> str | None:
    """Why ``value`` cannot be a checkpoint's ``extra`` (which must load without running
    code): ``None`` if it is made of dicts (keyed by strings or numbers), lists, tuples,
    strings, numbers, booleans, ``None`` and tensors."""
    if depth > _EXTRA_DEPTH:
        return f"{where} is nested over {_EXTRA_DEPTH} deep"
    if value is None or isinstance(value, bool | int | float | str | torch.Tensor):
        return None
    if isinstance(value, list | tuple):
        items = enumerate(value)
    elif isinstance(value, dict):
        for key in value:
            if not isinstance(key, str | int | float | bool):
                return f"{where} has a key of type {_type_name(key)}"
        items = value.items()  # type: ignore[assignment]
    else:
        return (
            f"{where} is a {_type_name(value)}; a checkpoint's extra holds only dicts, lists, "
            "tuples, strings, numbers, booleans, None and tensors, so that loading it runs "
            "no code"
        )
    for key, item in items:
        problem = extra_problem(item, f"{where}[{key!r}]", depth + 1)
        if problem is not None:
            return problem
    return None


def _type_name(value: Any) -> str:
    kind = type(value)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


def _agree(problem: str | None, group: dist.ProcessGroup | None) -> None:
    """Raise ``ValueError`` on every rank of ``group`` if any rank has a ``problem``."""
    problems = [problem]
    if dist.is_initialized():
        problems = [None] * dist.get_world_size(group)
        dist.all_gather_object(problems, problem, group=group)
    first = next((p for p in problems if p is not None), None)
    if first is not None:
        raise ValueError(first)


def read(
    state: dict[str, Any],
    path: str | os.PathLike,
    group: dist.ProcessGroup | None = None,
    *,
    distributed: bool = True,
    trust: bool = False,
) -> None:
    """Fill ``state``'s entries from the checkpoint at ``path``: tensors in place, other
    objects replaced. With ``distributed`` every rank of ``group`` calls it. Unless
    ``trust``, the files read must match the checkpoint's manifest and the entries may
    hold only tensors and plain data (see :mod:`pipetrain.checkpoint.reader`).

    Raises:
        CheckpointIntegrityError: the checkpoint has no manifest or differs from it.
        UnsafeCheckpoint: an object in it would run code to load.
        RuntimeError: reading failed otherwise (one line naming the rank).
    """
    reader = CheckedReader(path, trust=trust)
    reader.read_metadata()  # a refusal is raised here, before any collective
    with warnings.catch_warnings():
        # DCP warns that it reads in one process, which is what distributed=False asks
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        try:
            dcp.load(
                state,
                storage_reader=reader,
                planner=CheckedPlanner(path, trust=trust),
                process_group=group,
                no_dist=not distributed,
            )
        except CheckpointException as failure:
            raise loading_error(failure, path) from None


def contents(
    path: str | os.PathLike, *, trust: bool = False
) -> dict[str, TensorStorageMetadata | None]:
    """Every key in the checkpoint at ``path``: a tensor's metadata (size and dtype), or
    ``None`` for another object. The metadata is checked as :func:`read` checks it."""
    metadata = CheckedReader(path, trust=trust).read_metadata().state_dict_metadata
    return {
        key: value if isinstance(value, TensorStorageMetadata) else None
        for key, value in metadata.items()
    }


def empty_like(entry: TensorStorageMetadata) -> torch.Tensor:
    """A CPU tensor to read a saved tensor into."""
    return torch.empty(entry.size, dtype=entry.properties.dtype)


def read_everything(path: str | os.PathLike, *, trust: bool = False) -> dict[str, Any]:
    """Every entry of the checkpoint at ``path``, read in this process alone (checked as
    :func:`read` checks them)."""
    found = contents(path, trust=trust)
    state: dict[str, Any] = {
        key: None if entry is None else empty_like(entry) for key, entry in found.items()
    }
    read(state, path, distributed=False, trust=trust)
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
    """This process's random-number states: torch's CPU and CUDA ones, Python's and NumPy's
    (as lists and numbers, which load without running code)."""
    version, internal, gauss_next = random.getstate()
    kind, keys, position, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        "python": [version, list(internal), gauss_next],
        "numpy": [kind, np.asarray(keys).tolist(), int(position), int(has_gauss), float(cached)],
    }


def restore_random_states(states: Mapping[str, Any]) -> None:
    """Put back what :func:`random_states` returned (or the tuples it once returned)."""
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    version, internal, gauss_next = states["python"]
    random.setstate((version, tuple(internal), gauss_next))
    kind, keys, position, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))
