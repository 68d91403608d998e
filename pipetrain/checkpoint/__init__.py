"""Saving and resuming training: a pipeline's whole state in one checkpoint that any
layout, and the unpipelined model, can load.

- :func:`save` / :func:`load`: every rank of a :class:`~pipetrain.Pipeline` together
  (also ``pipe.save`` / ``pipe.load``);
- :func:`load_full`: into the unpipelined model, its optimizer and scheduler, in one process;
- :func:`export`: to a single :func:`torch.save` file;
- :func:`latest`: the newest complete checkpoint under a directory.

Each name is imported on first use: ``torch.distributed.checkpoint`` takes about a second
to import, which a process that never saves (or only looks for the newest checkpoint)
need not pay.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipetrain.checkpoint.directory import checkpoints, latest
    from pipetrain.checkpoint.entries import CheckpointMismatch
    from pipetrain.checkpoint.full import export, load_full
    from pipetrain.checkpoint.pipeline_state import Checkpoint, load, save
    from pipetrain.checkpoint.state import TrainingState

_HOMES = {
    "Checkpoint": "pipeline_state",
    "CheckpointMismatch": "entries",
    "TrainingState": "state",
    "checkpoints": "directory",
    "export": "full",
    "latest": "directory",
    "load": "pipeline_state",
    "load_full": "full",
    "save": "pipeline_state",
}

__all__ = [
    "Checkpoint",
    "CheckpointMismatch",
    "TrainingState",
    "checkpoints",
    "export",
    "latest",
    "load",
    "load_full",
    "save",
]


def __getattr__(name: str) -> Any:
    """Import ``name`` from its module on first use."""
    if name not in _HOMES:
        raise AttributeError(f"module 'pipetrain.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pipetrain.checkpoint.{_HOMES[name]}"), name)
