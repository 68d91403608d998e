"""Saving and resuming training: a pipeline's whole state in one checkpoint that any
layout, and the unpipelined model, can load.

- :func:`save` / :func:`load`: every rank of a :class:`~pipetrain.Pipeline` together
  (also ``pipe.save`` / ``pipe.load``);
- :func:`load_full`: into the unpipelined model, its optimizer and scheduler, in one process;
- :func:`export`: to a single :func:`torch.save` file;
- :func:`latest`: the newest complete checkpoint under a directory.
"""

from pipetrain.checkpoint.directory import checkpoints, latest
from pipetrain.checkpoint.entries import CheckpointMismatch
from pipetrain.checkpoint.full import export, load_full
from pipetrain.checkpoint.pipeline_state import Checkpoint, load, save
from pipetrain.checkpoint.state import TrainingState

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
