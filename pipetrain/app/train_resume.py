"""Saving and resuming ``pipetrain train`` runs: with a save directory, a run saves every
``save_every`` steps and at its last, and a restarted run (by hand, or by ``torchrun
--max-restarts`` after a worker died) goes on from the newest complete checkpoint there,
with the same losses and weights as a run that was never stopped."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pipetrain.app.run_settings import SETTINGS, run_settings
from pipetrain.app.train_config import TrainConfig
from pipetrain.checkpoint import latest
from pipetrain.checkpoint.directory import step_of

if TYPE_CHECKING:
    from pipetrain.runtime import Pipeline


class Positioned(Protocol):
    """Training data whose reading position is saved with a checkpoint."""

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch read."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from a saved position."""


@dataclass
class History:
    """What a run has done: its steps' losses and times and its held-out evaluations."""

    losses: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    evaluations: list[dict[str, float]] = field(default_factory=list)

    @property
    def steps(self) -> int:
        """Steps done, which is the index of the next step."""
        return len(self.losses)


class RunFinished(Exception):
    """A restart found the run finished: its newest checkpoint, ``checkpoint``, is at the
    last step, ``steps``."""

    def __init__(self, checkpoint: str, steps: int) -> None:
        super().__init__(
            f"the run had finished before this restart: {checkpoint} holds its last step, "
            f"{steps}; nothing is left to train"
        )
        self.checkpoint, self.steps = checkpoint, steps


def check_resumable(config: TrainConfig) -> None:
    """Check, before any worker trains, that the save directory's newest checkpoint leaves
    steps to train.

    Raises:
        RunFinished: it is at the last step and this is a restart by ``torchrun`` (a worker
            ended abnormally after the final save, so nothing is left to do).
        ValueError: it is at or past the last step, on a run started by hand.
    """
    if config.save_dir is None:
        return
    newest = latest(config.save_dir)
    if newest is None or step_of(newest) < config.steps:
        return
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if restarted and step_of(newest) == config.steps:
        raise RunFinished(str(newest), config.steps)
    raise ValueError(
        f"the newest checkpoint, {newest}, is at step {step_of(newest)}, and the run has "
        f"{config.steps} steps: nothing is left to train; give more --steps or another "
        "--save-dir"
    )


def resume(pipe: Pipeline, config: TrainConfig, batches: Positioned | None) -> History:
    """Load the newest checkpoint in the save directory into ``pipe`` and ``batches`` and
    return the history saved with it; an empty history if there is none."""
    if config.save_dir is None or latest(config.save_dir) is None:
        return History()
    found = pipe.load(config.save_dir)
    saved = found.extra
    missing = [key for key in _SAVED if not isinstance(saved, dict) or key not in saved]
    if missing:
        raise ValueError(
            f"{found.path} was not saved by pipetrain train (its extra lacks "
            f"{', '.join(missing)}); give --save-dir a directory of this command's checkpoints"
        )
    if batches is not None:
        batches.load_state_dict(saved["data"])
    if pipe.rank == 0:
        print(f"resumed from {found.path} after step {found.step}", file=sys.stderr, flush=True)
    return History(saved["losses"], saved["step_times_s"], saved["evaluations"])


_SAVED = ("data", "losses", "step_times_s", "evaluations")
"""What :func:`save_if_due` keeps in a checkpoint's ``extra`` and :func:`resume` reads."""


def save_if_due(
    pipe: Pipeline, config: TrainConfig, batches: Positioned | None, history: History
) -> None:
    """Save the run after its latest step if that is a multiple of ``save_every`` or the
    last; rank 0's data position and history travel with the checkpoint. A stale
    ``roundpipe`` run's waiting step is applied first, so a run resumed from the
    checkpoint goes on as the saving run does."""
    step = history.steps
    if config.save_dir is None:
        return
    if step != config.steps and (config.save_every is None or step % config.save_every):
        return
    extra = {
        SETTINGS: run_settings(config),  # compared when a run resumes from it
        "data": None if batches is None else batches.state_dict(),
        "losses": history.losses,
        "step_times_s": history.step_times_s,
        "evaluations": history.evaluations,
    }
    if pipe.schedule.options.get("stale"):
        pipe.update()  # the step waiting for the next update, applied: a checkpoint keeps none
    pipe.save(config.save_dir, step=step, extra=extra, keep=config.keep_checkpoints)
