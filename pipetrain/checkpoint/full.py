"""A checkpoint in one process: loaded into the unpipelined model, or exported to one file."""

from __future__ import annotations

import os
from collections.abc import Mapping
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
    *,
    trust: bool = False,
) -> Checkpoint:
    """Load a pipeline's checkpoint (``path``, or the newest complete one under it) into the
    unpipelined ``model`` in this process alone, and its optimizer state into ``optimizer``
    (whose parameters are ``model``'s) and its scheduler's into ``lr_scheduler``, if given.
    ``trust=True`` loads a checkpoint without a manifest, or one whose objects would run
    code to load: only for checkpoints from a trusted source.

    Raises:
        FileNotFoundError: no complete checkpoint is there.
        CheckpointIntegrityError: the checkpoint is incomplete or damaged, or has no manifest.
        UnsafeCheckpoint: an object in the checkpoint would run code to load; it names it.
        CheckpointMismatch: naming each parameter or buffer that differs between the
            checkpoint and ``model``, or optimizer state that is missing.
    """
    found = resolve(path, trust=trust)
    saved = contents(found, trust=trust)
    everywhere = set(model.state_dict())
    names = _saved_names(model, saved)
    # a tied parameter is saved under one of its names; it fills the others
    held = {k: v for k, v in model.state_dict().items() if k not in _other_names(model, names)}
    problems = model_differences(saved, held, everywhere)
    wanted: dict[str, Any] = {MODEL + name: tensor for name, tensor in held.items()}
    wanted.update({PROGRESS: None, EXTRA: None, LAYOUT: None})
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
    read(wanted, found, distributed=False, trust=trust)
    if optimizer is not None:
        named_optimizer.restore(optimizer, names, wanted)
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(wanted[LR_SCHEDULER])
    progress = wanted[PROGRESS]
    return Checkpoint(found, progress["step"], progress["updates"], wanted[EXTRA], wanted[LAYOUT])


def _saved_names(model: nn.Module, saved: Mapping[str, Any]) -> dict[int, str]:
    """Each parameter's name, among its names (several for a tied one), that the
    checkpoint holds (else its first)."""
    aliases: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(parameter), []).append(name)
    return {
        key: next((n for n in names if MODEL + n in saved), names[0])
        for key, names in aliases.items()
    }


def _other_names(model: nn.Module, chosen: dict[int, str]) -> set[str]:
    """The names of tied parameters other than the one chosen for each."""
    return {
        name
        for name, parameter in model.named_parameters(remove_duplicate=False)
        if chosen[id(parameter)] != name
    }


def export(path: str | os.PathLike, out: str | os.PathLike, *, trust: bool = False) -> Path:
    """Write a pipeline's checkpoint (``path``, or the newest complete one under it) as one
    :func:`torch.save` file at ``out`` and return the checkpoint's directory.

    The file holds a dict: ``model`` (the full model's ``state_dict``), ``optimizer``
    (``{"state": {name: {key: value}}, "groups": {name: hyperparameters}}``, by parameter
    name), ``lr_scheduler`` and ``precision`` (``state_dict()``s or ``None``), ``progress``
    (``step``, ``updates``, ``skipped_updates``), ``extra`` and ``layout``. The checkpoint is
    checked, and ``trust`` allowed, as by :func:`load_full`.
    """
    found = resolve(path, trust=trust)
    entries = read_everything(found, trust=trust)
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
