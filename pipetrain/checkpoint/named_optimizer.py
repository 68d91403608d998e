"""An optimizer's state keyed by parameter name, so that it moves between layouts.

``torch.optim.Optimizer.state_dict()`` numbers parameters by their position in this
optimizer, which differs on every rank and in the unpipelined model. Here each parameter's
state is saved under its full-model name (``optimizer/NAME/exp_avg``), beside the
hyperparameters of its group (``optimizer_group/NAME``); loading rebuilds the numbered form
for whichever optimizer holds those names.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from pipetrain.checkpoint.entries import (
    OPTIMIZER,
    OPTIMIZER_GROUP,
    CheckpointMismatch,
    empty_like,
)
from pipetrain.checkpoint.entries import names as prefixed_names

_ADDED = {"initial_lr"}  # a setting a learning-rate scheduler adds to the optimizer's groups

Names = Mapping[int, str]
"""The full-model name of each parameter, by ``id(parameter)``."""


def _name(names: Names, parameter: torch.Tensor) -> str:
    try:
        return names[id(parameter)]
    except KeyError:
        raise ValueError(
            f"the optimizer holds a parameter of shape {list(parameter.shape)} that is not "
            "one of the model's; a checkpoint names every parameter it saves"
        ) from None


def _hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


def entries(optimizer: torch.optim.Optimizer, names: Names) -> dict[str, Any]:
    """The optimizer's state and group hyperparameters as checkpoint entries by name."""
    found: dict[str, Any] = {}
    for group in optimizer.param_groups:
        hyperparameters = _hyperparameters(group)
        for parameter in group["params"]:
            name = _name(names, parameter)
            found[OPTIMIZER_GROUP + name] = hyperparameters
            for key, value in optimizer.state.get(parameter, {}).items():
                found[f"{OPTIMIZER}{name}/{key}"] = value
    return found


def requests(
    optimizer: torch.optim.Optimizer, names: Names, saved: Mapping[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """The entries to read for ``optimizer`` from a checkpoint's contents ``saved`` (see
    :func:`~pipetrain.checkpoint.entries.contents`), and what the checkpoint lacks."""
    wanted: dict[str, Any] = {}
    problems = []
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            name = _name(names, parameter)
            if OPTIMIZER_GROUP + name not in saved:
                problems.append(f"the optimizer state of {name} is not in the checkpoint")
                continue
            wanted[OPTIMIZER_GROUP + name] = None
            for key in prefixed_names(saved, f"{OPTIMIZER}{name}/"):
                entry = saved[f"{OPTIMIZER}{name}/{key}"]
                wanted[f"{OPTIMIZER}{name}/{key}"] = (
                    None if entry is None else _read_into(entry, parameter)
                )
    return wanted, problems


def _read_into(entry: Any, parameter: torch.Tensor) -> torch.Tensor:
    """Where to read a saved optimizer tensor of ``parameter``: a tensor laid out as the
    parameter is where that is split (a sharded or tensor-parallel ``DTensor``, whose
    optimizer state must be one too: each process reads only its part), else a CPU tensor."""
    # no DTensor exists before its module is imported, and importing it costs seconds
    dtensor = sys.modules.get("torch.distributed.tensor")
    if (
        dtensor is not None
        and isinstance(parameter, dtensor.DTensor)
        and tuple(entry.size) == tuple(parameter.shape)
    ):
        return torch.empty_like(parameter, dtype=entry.properties.dtype)
    return empty_like(entry)


def _equal(a: Any, b: Any) -> bool:
    """Equality of hyperparameter values, which may be tensors or hold them."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


def restore(optimizer: torch.optim.Optimizer, names: Names, read: Mapping[str, Any]) -> None:
    """Load the entries :func:`requests` asked for, once read, into ``optimizer``.

    Raises:
        CheckpointMismatch: the saved hyperparameters are another optimizer's, or the
            parameters of one of this optimizer's groups were saved in different groups.
    """
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for number, group in enumerate(optimizer.param_groups):
        own = _hyperparameters(group)
        group_names = [_name(names, p) for p in group["params"]]
        saved = [read[OPTIMIZER_GROUP + name] for name in group_names] or [own]
        kind, expected = sorted(set(saved[0]) - _ADDED), sorted(set(own) - _ADDED)
        if kind != expected:
            raise CheckpointMismatch(
                f"the checkpoint's optimizer has the settings {kind}, but this one has "
                f"{expected}: it was saved with another kind of optimizer"
            )
        for name, hyperparameters in zip(group_names, saved):
            if not _equal(hyperparameters, saved[0]):
                raise CheckpointMismatch(
                    f"parameters {group_names[0]} and {name} are in one group of optimizer "
                    f"group {number}, but were saved with different settings"
                )
        groups.append({**saved[0], "params": list(range(index, index + len(group_names)))})
        for name in group_names:
            prefix = f"{OPTIMIZER}{name}/"
            values = {key[len(prefix) :]: v for key, v in read.items() if key.startswith(prefix)}
            if values:
                state[index] = values
            index += 1
    optimizer.load_state_dict({"state": state, "param_groups": groups})
