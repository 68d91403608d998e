"""Saving and loading a :class:`~pipetrain.runtime.pipeline.Pipeline`'s whole training state.

Every rank of the pipeline's group calls :func:`save` (or :func:`load`) together. Each rank
contributes what it holds, keyed by full-model names (see
:mod:`pipetrain.checkpoint.entries`), and a replicated stage is written once; loading
reads, on each rank, the entries its own stages need. So a checkpoint taken with one
layout (balance, stage count, schedule, replicas) loads into any other, and into the
unpipelined model (:func:`pipetrain.checkpoint.load_full`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import pipetrain.checkpoint.named_optimizer as named_optimizer
from pipetrain.checkpoint.directory import (
    clear_temporary,
    commit,
    prune,
    resolve,
    step_path,
    temporary_path,
)
from pipetrain.checkpoint.entries import (
    EXTRA,
    LAYOUT,
    LR_SCHEDULER,
    MODEL,
    PRECISION,
    PROGRESS,
    RNG,
    contents,
    model_differences,
    random_states,
    read,
    refuse,
    restore_random_states,
    write,
)

if TYPE_CHECKING:
    from pipetrain.runtime.pipeline import Pipeline


@dataclass(frozen=True)
class Checkpoint:
    """What a load found: the directory, the step it was saved at, the updates applied by
    then, the caller's ``extra`` object and the saving pipeline's layout."""

    path: Path
    step: int
    updates: int
    extra: Any
    layout: dict[str, Any]


def _together(group: dist.ProcessGroup | None, rank: int, work: Callable[[], None]) -> None:
    """Run ``work`` on rank 0 while the others wait; if it fails, every rank raises."""
    error = None
    if rank == 0:
        try:
            work()
        except Exception as failure:  # reported on every rank, which would otherwise wait
            error = f"{type(failure).__name__}: {failure}"
    errors: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    if errors[0] is not None:
        raise RuntimeError(f"saving the checkpoint failed on rank 0: {errors[0]}")


def _precision(pipe: Pipeline) -> Any:
    """The pipeline's loss scaler, if it has one with a state."""
    precision = getattr(pipe, "precision", None)
    return precision if callable(getattr(precision, "state_dict", None)) else None


def _held(pipe: Pipeline) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers by full-model name (sharing their storage)."""
    held: dict[str, torch.Tensor] = {}
    for module in pipe.stages.values():
        held.update(module.state_dict())
    return held


def _parameter_names(pipe: Pipeline) -> dict[int, str]:
    return {id(parameter): name for name, parameter in pipe.named_parameters()}


def _layout(pipe: Pipeline) -> dict[str, Any]:
    schedule = pipe.schedule
    return {
        "schedule": schedule.name,
        "asynchronous": schedule.asynchronous,
        "balance": list(pipe.balance),
        "stage_ranks": [list(ranks) for ranks in schedule.stage_ranks],
        "microbatches": pipe.microbatches,
    }


def _state(pipe: Pipeline, step: int, extra: Any) -> dict[str, Any]:
    """The entries this rank saves."""
    if pipe._accumulated:
        raise RuntimeError(
            "gradients of train_step(..., update=False) wait for an update, and a checkpoint "
            "does not keep them; save after an updating step"
        )
    for stage, stash in pipe.weights.stashes.items():
        if len(stash.versions) != 1:  # a call drains the pipeline: only the newest is left
            raise RuntimeError(f"stage {stage} holds {len(stash.versions)} weight versions")
    state: dict[str, Any] = {MODEL + name: tensor for name, tensor in _held(pipe).items()}
    if pipe.optimizer is not None:
        state.update(named_optimizer.entries(pipe.optimizer, _parameter_names(pipe)))
    if pipe.lr_scheduler is not None:
        state[LR_SCHEDULER] = pipe.lr_scheduler.state_dict()
    precision = _precision(pipe)
    if precision is not None:
        state[PRECISION] = precision.state_dict()
    state[f"{RNG}{dist.get_rank()}"] = random_states()
    if pipe.rank == 0:
        state[PROGRESS] = {
            "step": step,
            "updates": pipe.updates,
            "skipped_updates": pipe.skipped_updates,
        }
        state[EXTRA] = extra
        state[LAYOUT] = _layout(pipe)
    return state


def save(
    pipe: Pipeline,
    root: str | os.PathLike,
    *,
    step: int | None = None,
    extra: Any = None,
    keep: int | None = None,
) -> Path:
    """Save ``pipe``'s training state as ``root/step-NNNNNNNN`` and return that directory.

    Every rank calls it, between steps (after an updating one). Saved: parameters and
    buffers and the optimizer's state by full-model name, the learning-rate scheduler, the
    loss scaler (``pipe.precision``, if the pipeline has one), the counts of applied and
    skipped updates (which also number an asynchronous schedule's weight versions), every
    rank's random-number states, and ``extra``: any picklable object of rank 0's, such as
    the data position, given back by :func:`load`. ``step`` names the checkpoint (by
    default the updates applied so far). The directory appears only once every rank has
    written its part, so a save that dies half-way is never loaded; with ``keep``, only the
    ``keep`` newest checkpoints stay.

    Raises:
        RuntimeError: on every rank, if rank 0 could not prepare, rename or prune the
            directories, or a step's gradients wait for an update.
    """
    step = pipe.updates if step is None else step
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be a positive integer or None, got {keep!r}")
    state = _state(pipe, step, extra)
    _together(pipe.group, pipe.rank, lambda: clear_temporary(root))
    write(state, temporary_path(root, step), pipe.group)

    def finish() -> None:
        commit(root, step)
        if keep is not None:
            prune(root, keep)

    _together(pipe.group, pipe.rank, finish)
    return step_path(root, step)


def load(pipe: Pipeline, path: str | os.PathLike, *, weights_only: bool = False) -> Checkpoint:
    """Load a checkpoint into ``pipe``: ``path`` itself, or the newest complete one under it.

    Every rank calls it. Each rank reads its stages' parameters and buffers and, unless
    ``weights_only``, its optimizer's state, its learning-rate scheduler and loss scaler,
    its random-number states (if the saving run had this rank) and the update counts.
    Returns what was found, with the ``extra`` object given to :func:`save`.

    Raises:
        FileNotFoundError: no complete checkpoint is there.
        CheckpointMismatch: on every rank, naming each parameter or buffer that is missing,
            shaped differently or unknown to the model, or state the optimizer lacks.
    """
    found = resolve(path)
    saved = contents(found)
    held = _held(pipe)
    every: list[list[str]] = [[] for _ in range(dist.get_world_size(pipe.group))]
    dist.all_gather_object(every, sorted(held), group=pipe.group)
    problems = model_differences(saved, held, {name for names in every for name in names})
    wanted: dict[str, Any] = {MODEL + name: tensor for name, tensor in held.items()}
    wanted.update({PROGRESS: None, EXTRA: None, LAYOUT: None})
    names = _parameter_names(pipe)
    precision = _precision(pipe)
    if not weights_only:
        if pipe.optimizer is not None:
            requested, missing = named_optimizer.requests(pipe.optimizer, names, saved)
            wanted.update(requested)
            problems += missing
        if pipe.lr_scheduler is not None:
            if LR_SCHEDULER in saved:
                wanted[LR_SCHEDULER] = None
            else:
                problems.append("the checkpoint has no learning-rate scheduler state")
        if precision is not None and PRECISION in saved:
            wanted[PRECISION] = None
        if f"{RNG}{dist.get_rank()}" in saved:
            wanted[f"{RNG}{dist.get_rank()}"] = None
    gathered: list[list[str]] = [[] for _ in every]
    dist.all_gather_object(gathered, problems, group=pipe.group)
    refuse(list(dict.fromkeys(p for rank in gathered for p in rank)), found)
    read(wanted, found, pipe.group)
    progress = wanted[PROGRESS]
    if not weights_only:
        _restore(pipe, wanted, names, progress)
    pipe.weights.reset()
    for parameter in pipe.parameters():
        parameter.grad = None
    pipe._accumulated = False
    return Checkpoint(found, progress["step"], progress["updates"], wanted[EXTRA], wanted[LAYOUT])


def _restore(
    pipe: Pipeline, read: dict[str, Any], names: dict[int, str], progress: dict[str, int]
) -> None:
    """Put the read state other than the weights into ``pipe``."""
    if pipe.optimizer is not None:
        named_optimizer.restore(pipe.optimizer, names, read)
    if pipe.lr_scheduler is not None:
        pipe.lr_scheduler.load_state_dict(read[LR_SCHEDULER])
    precision = _precision(pipe)
    if precision is not None and PRECISION in read:
        precision.load_state_dict(read[PRECISION])
    if f"{RNG}{dist.get_rank()}" in read:
        restore_random_states(read[f"{RNG}{dist.get_rank()}"])
    pipe.weights.updater.updates = progress["updates"]
    pipe.weights.updater.skipped_updates = progress["skipped_updates"]
    for stash in pipe.weights.stashes.values():
        stash.newest = progress["updates"]  # version v: the weights after v updates
