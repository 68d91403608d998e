"""A checkpoint in one process: loaded into the unpipelined model, or exported to one file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

import pipetrain.checkpoint.named_optimizer as named_optimizer
from pipetrain.checkpoint.directory import resolve
from pipetrain.checkpoint.entries import (
    EXTRA,
    LAYOUT,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    OPTIMIZER_GROUP,
    PRECISION,
    PROGRESS,
    contents,
    model_differences,
    read,
    read_everything,
    refuse,
)
from pipetrain.checkpoint.pipeline_state import Checkpoint


def load_full(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> Checkpoint:
    """Load a pipeline's checkpoint (``path``, or the newest complete one under it) into the
    unpipelined ``model`` in this process alone, and its optimizer state into ``optimizer``
    (whose parameters are ``model``'s) and its scheduler's into ``lr_scheduler``, if given.

    Raises:
        FileNotFoundError: no complete checkpoint is there.
        CheckpointMismatch: naming each parameter or buffer that differs between the
            checkpoint and ``model``, or optimizer state that is missing.
    """
    found = resolve(path)
    saved = contents(found)
    held = model.state_dict()
    problems = model_differences(saved, held, set(held))
    wanted: dict[str, Any] = {MODEL + name: tensor for name, tensor in held.items()}
    wanted.update({PROGRESS: None, EXTRA: None, LAYOUT: None})
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    if optimizer is not None:
        requested, missing = named_optimizer.requests(optimizer, names, saved)
        wanted.update(requested)
        problems += missing
    if lr_scheduler is not None:
        if LR_SCHEDULER in saved:
            wanted[LR_SCHEDULER] = None
        else:
            problems.append("the checkpoint has no learning-rate scheduler state")
    refuse(problems, found)
    read(wanted, found, distributed=False)
    if optimizer is not None:
        named_optimizer.restore(optimizer, names, wanted)
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(wanted[LR_SCHEDULER])
    progress = wanted[PROGRESS]
    return Checkpoint(found, progress["step"], progress["updates"], wanted[EXTRA], wanted[LAYOUT])


def export(path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write a pipeline's checkpoint (``path``, or the newest complete one under it) as one
    :func:`torch.save` file at ``out`` and return the checkpoint's directory.

    The file holds a dict: ``model`` (the full model's ``state_dict``), ``optimizer``
    (``{"state": {name: {key: value}}, "groups": {name: hyperparameters}}``, by parameter
    name), ``lr_scheduler`` and ``precision`` (``state_dict()``s or ``None``), ``progress``
    (``step``, ``updates``, ``skipped_updates``), ``extra`` and ``layout``.
    """
    found = resolve(path)
    entries = read_everything(found)
    state: dict[str, dict[str, Any]] = {}
    groups: dict[str, Any] = {}
    for key, value in entries.items():
        if key.startswith(OPTIMIZER_GROUP):
            groups[key[len(OPTIMIZER_GROUP) :]] = value
    for name in sorted(groups, key=len, reverse=True):  # a longer name first: "a.b" before "a"
        prefix = f"{OPTIMIZER}{name}/"
        for key in [k for k in entries if k.startswith(prefix)]:
            state.setdefault(name, {})[key[len(prefix) :]] = entries.pop(key)
    exported = {
        "model": {key[len(MODEL) :]: v for key, v in entries.items() if key.startswith(MODEL)},
        "optimizer": {"state": state, "groups": groups},
        "lr_scheduler": entries.get(LR_SCHEDULER),
        "precision": entries.get(PRECISION),
        "progress": entries[PROGRESS],
        "extra": entries.get(EXTRA),
        "layout": entries.get(LAYOUT),
    }
    torch.save(exported, out)
    return found
