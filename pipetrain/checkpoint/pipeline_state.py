"""Saving and loading a pipeline's whole training state, given as a
:class:`~pipetrain.checkpoint.state.TrainingState` by each rank.

Every rank of the pipeline's group calls :func:`save` (or :func:`load`) together. Each rank
contributes what it holds, keyed by full-model names (see
:mod:`pipetrain.checkpoint.entries`), and a replicated stage is written once; loading
reads, on each rank, the entries its own stages need. So a checkpoint taken with one
layout (balance, stage count, schedule, replicas) loads into any other, and into the
unpipelined model (:func:`pipetrain.checkpoint.load_full`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    OPTIMIZER_GROUP,
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
from pipetrain.checkpoint.state import HasTrainingState, TrainingState, state_of


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


def _state(state: TrainingState, step: int, extra: Any) -> dict[str, Any]:
    """The entries this rank saves."""
    updates, skipped_updates = state.cycle.progress()
    saved: dict[str, Any] = {MODEL + name: tensor for name, tensor in state.held().items()}
    if state.optimizer is not None:
        saved.update(named_optimizer.entries(state.optimizer, state.parameter_names()))
    if state.lr_scheduler is not None:
        saved[LR_SCHEDULER] = state.lr_scheduler.state_dict()
    if state.loss_scaler is not None:
        saved[PRECISION] = state.loss_scaler.state_dict()
    saved[f"{RNG}{dist.get_rank()}"] = random_states()
    if state.rank == 0:
        saved[PROGRESS] = {"step": step, "updates": updates, "skipped_updates": skipped_updates}
        saved[EXTRA] = extra
        saved[LAYOUT] = state.layout
    return saved


def save(
    source: TrainingState | HasTrainingState,
    root: str | os.PathLike,
    *,
    step: int | None = None,
    extra: Any = None,
    keep: int | None = None,
) -> Path:
    """Save the training state of every rank (``source``: a pipeline, or the
    :class:`~pipetrain.checkpoint.state.TrainingState` it gives) as ``root/step-NNNNNNNN``
    and return that directory.

    Every rank calls it, between steps (after an updating one). Saved: parameters and
    buffers and the optimizer's state by full-model name, the learning-rate scheduler, the
    loss scaler (if there is one), the counts of applied and skipped updates (which also
    number an asynchronous schedule's weight versions), every rank's random-number states,
    and ``extra``: rank 0's plain data (dicts, lists, strings, numbers, tensors), such as
    the data position, given back by :func:`load`. ``step`` names the checkpoint (by
    default the updates applied so far). The directory appears only once every rank has
    written its part, so a save that dies half-way is never loaded; with ``keep``, only the
    ``keep`` newest checkpoints stay.

    Raises:
        RuntimeError: on every rank, if rank 0 could not prepare, rename or prune the
            directories, or a step's gradients wait for an update.
    """
    state = state_of(source)
    step = state.cycle.progress()[0] if step is None else step
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be a positive integer or None, got {keep!r}")
    saved = _state(state, step, extra)
    _together(state.group, state.rank, lambda: clear_temporary(root))
    write(saved, temporary_path(root, step), state.group)

    def finish() -> None:
        commit(root, step)
        if keep is not None:
            prune(root, keep)

    _together(state.group, state.rank, finish)
    return step_path(root, step)


def load(
    source: TrainingState | HasTrainingState,
    path: str | os.PathLike,
    *,
    weights_only: bool = False,
    trust: bool = False,
) -> Checkpoint:
    """Load a checkpoint into the training state of every rank (``source``: a pipeline, or
    the :class:`~pipetrain.checkpoint.state.TrainingState` it gives): ``path`` itself, or the
    newest complete one under it.

    Every rank calls it. Each rank reads its stages' parameters and buffers and, unless
    ``weights_only``, its optimizer's state, its learning-rate scheduler and loss scaler,
    its random-number states (if the saving run had this rank) and the update counts.
    Returns what was found, with the ``extra`` object given to :func:`save`. Nothing read
    runs code; ``trust=True`` reads checkpoints written before manifests existed, whose
    entries may be any pickle (only for files you wrote).

    Raises:
        FileNotFoundError: no complete checkpoint is there.
        CheckpointMismatch: on every rank, naming each parameter or buffer that is missing,
            shaped differently or unknown to the model, or state the optimizer lacks.
    """
    state = state_of(source)
    found = resolve(path, trust=trust)
    saved = contents(found, trust=trust)
    held = state.held()
    every: list[list[str]] = [[] for _ in range(dist.get_world_size(state.group))]
    dist.all_gather_object(every, sorted(held), group=state.group)
    problems = model_differences(saved, held, {name for names in every for name in names})
    wanted: dict[str, Any] = {MODEL + name: tensor for name, tensor in held.items()}
    wanted.update({PROGRESS: None, EXTRA: None, LAYOUT: None})
    names = _saved_names(state, saved)
    rng = f"{RNG}{dist.get_rank()}"
    if not weights_only:
        if state.optimizer is not None:
            requested, missing = named_optimizer.requests(state.optimizer, names, saved)
            wanted.update(requested)
            problems += missing
        if state.lr_scheduler is not None:
            if LR_SCHEDULER in saved:
                wanted[LR_SCHEDULER] = None
            else:
                problems.append("the checkpoint has no learning-rate scheduler state")
        if state.loss_scaler is not None and PRECISION in saved:
            wanted[PRECISION] = None
        if rng in saved:
            wanted[rng] = None
    gathered: list[list[str]] = [[] for _ in every]
    dist.all_gather_object(gathered, problems, group=state.group)
    refuse(list(dict.fromkeys(p for rank in gathered for p in rank)), found)
    read(wanted, found, state.group, trust=trust)
    progress = wanted[PROGRESS]
    if weights_only:
        state.cycle.restore(None)
    else:
        if state.optimizer is not None:
            named_optimizer.restore(state.optimizer, names, wanted)
        if state.lr_scheduler is not None:
            state.lr_scheduler.load_state_dict(wanted[LR_SCHEDULER])
        if state.loss_scaler is not None and PRECISION in wanted:
            state.loss_scaler.load_state_dict(wanted[PRECISION])
        if rng in wanted:
            restore_random_states(wanted[rng])
        state.cycle.restore((progress["updates"], progress["skipped_updates"]))
    return Checkpoint(found, progress["step"], progress["updates"], wanted[EXTRA], wanted[LAYOUT])


def saved_extra(path: str | os.PathLike) -> tuple[Path, Any]:
    """The checkpoint :func:`load` would read at ``path`` (itself, or the newest intact one
    under it) and the ``extra`` object saved with it, read in this process alone and
    checked as :func:`load` checks it; no tensor of the model is read.

    Raises:
        FileNotFoundError: no complete checkpoint is there.
    """
    found = resolve(path)
    wanted: dict[str, Any] = {EXTRA: None}
    if EXTRA in contents(found):
        read(wanted, found, distributed=False)
    return found, wanted[EXTRA]


def _saved_names(state: TrainingState, saved: Mapping[str, Any]) -> dict[int, str]:
    """Each parameter's name, by ``id``, as the checkpoint ``saved`` keys its optimizer
    state: of a tied parameter's names (a stage holds it under each), the first saved,
    whichever the saving layout's stages listed first (else the first held)."""
    aliases: dict[int, list[str]] = {}
    for module in state.modules.values():
        for name, parameter in module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(parameter), []).append(name)
    return {
        key: next((n for n in names if OPTIMIZER_GROUP + n in saved), names[0])
        for key, names in aliases.items()
    }
