"""Worker functions for the checkpoint-trust tests (importable by spawned workers), and
crafted checkpoints: one whose metadata runs a command when unpickled, one whose entry does,
one saved the old way (no manifest, NumPy arrays in the random states)."""

from __future__ import annotations

import os
import pickle
import random
import shutil
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import checkpoint_cases as cases
import numpy as np
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pipeline_cases import mlp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from pipetrain import checkpoint
from pipetrain.checkpoint import entries, manifest

STEP = f"step-{cases.SAVED_AT:08d}"


class Payload:
    """Unpickled, runs ``command`` in a shell."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (self.command,)


def _outcome(work: Any) -> str:
    try:
        work()
    except Exception as error:  # reported to the test, which checks its kind and words
        return f"{type(error).__name__}: {error}"
    return "ok"


def save_runs(root: str) -> dict[str, str]:
    """On two ranks: an honest checkpoint, and the saves that must be refused."""
    pipe = cases.make_pipe(mlp(), balance=[2, 3], microbatches=2)
    cases.train_steps(pipe, 0, cases.SAVED_AT)
    checkpoint.save(pipe, os.path.join(root, "honest"), extra={"next": cases.SAVED_AT})
    return {
        "bad_extra": _outcome(
            lambda: checkpoint.save(pipe, os.path.join(root, "bad"), extra={"x": {1, 2}})
        ),
        "locked": _outcome(lambda: checkpoint.save(pipe, os.path.join(root, "locked"))),
    }


def load_runs(root: str, names: list[str]) -> dict[str, str]:
    """On two ranks: ``pipe.load`` of each checkpoint under ``root`` named in ``names``."""
    outcomes = {}
    for name in names:
        pipe = cases.make_pipe(mlp(seed=5), balance=[2, 3], microbatches=2)
        outcomes[name] = _outcome(partial(checkpoint.load, pipe, os.path.join(root, name)))
        dist.barrier()
    return outcomes


def _save(state: dict[str, Any], path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: saving in one process
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(path),
            planner=DefaultSavePlanner(flatten_state_dict=False),
            no_dist=True,
        )


def evil_metadata(honest: Path, out: Path, command: str) -> Path:
    """``honest`` with a command in its ``.metadata``, and a manifest that vouches for it."""
    shutil.copytree(honest, out)
    with open(out / manifest.METADATA, "rb") as file:
        metadata = pickle.load(file)  # our own honest file
    metadata.planner_data = Payload(command)
    with open(out / manifest.METADATA, "wb") as file:
        pickle.dump(metadata, file)
    manifest.write(out)
    return out


def evil_entry(honest: Path, out: Path, command: str) -> Path:
    """``honest`` with a command as its ``extra`` entry, and a manifest that vouches for it."""
    state = entries.read_everything(honest)
    state[entries.EXTRA] = Payload(command)
    _save(state, out)
    manifest.write(out)
    return out


def old_style(honest: Path, out: Path) -> Path:
    """``honest`` as an older pipetrain saved it: no manifest, and random states holding
    tuples and a NumPy array."""
    state = entries.read_everything(honest)
    for key, value in state.items():
        if key.startswith(entries.RNG):
            value["python"] = random.getstate()
            value["numpy"] = np.random.get_state()
    _save(state, out)
    return out
