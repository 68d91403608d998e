"""A ``pipetrain train`` run's settings, kept in every checkpoint it saves and compared when
a run resumes from one.

A run that resumes with other settings than those saved is refused, naming each one, unless
it says ``--new-settings``; then the new ones apply: the restored optimizer's learning rate
(and its scheduler's base) becomes the new one, a new seed starts a new data order, and a
new batch size or accumulation takes effect from the next step. The model, the
learning-rate schedule, the precision and a corpus of one's own (``--data``, its tokenizer
and ``--seq-len-max``) cannot change in a resumed run.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pipetrain.app.train_config import TrainConfig
from pipetrain.checkpoint import latest

if TYPE_CHECKING:
    from pipetrain.runtime import Pipeline

SETTINGS = "settings"  # the key of a checkpoint's extra that holds them

FLAGS = {
    "model": "--model",
    "seed": "--seed",
    "batch_size": "--batch-size",
    "lr": "--lr",
    "lr_schedule": "--lr-schedule",
    "accumulate": "--accumulate",
    "max_grad_norm": "--max-grad-norm",
    "precision": "--precision",
    "data": "--data",
    "tokenizer": "--tokenizer",
    "seq_len_max": "--seq-len-max",
    "microbatch_tokens": "--microbatch-tokens",
}
"""The settings compared, by name, with the flag that gives each."""

FIXED = ("model", "lr_schedule", "precision", "data", "tokenizer", "seq_len_max")
"""Settings a resumed run cannot change: the checkpoint's state is made for them."""


def run_settings(config: TrainConfig) -> dict[str, Any]:
    """The compared settings of a resolved configuration, as plain values."""
    return {
        "model": config.model,
        "seed": config.seed,
        "batch_size": config.samples,
        "lr": config.learning_rate,
        "lr_schedule": config.lr_schedule,
        "accumulate": config.accumulate,
        "max_grad_norm": config.update.max_grad_norm,
        "precision": config.update.precision,
        # a corpus's reading position and the GPT's vocabulary and context are its own
        "data": None if config.data is None else config.data.path,
        "tokenizer": None if config.data is None else config.data.tokenizer,
        "seq_len_max": None if config.data is None else config.data.seq_len_max,
        "microbatch_tokens": config.pipeline.microbatch_tokens,
    }


def differences(saved: Mapping[str, Any], config: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """Each compared setting whose saved value differs from the configuration's, with both
    values (saved, new); settings the checkpoint does not hold are not compared."""
    current = run_settings(config)
    return {
        name: (saved[name], current[name])
        for name in FLAGS
        if name in saved and saved[name] != current[name]
    }


def _listed(changed: Mapping[str, tuple[Any, Any]], which: int) -> str:
    return ", ".join(f"{FLAGS[name]} {values[which]}" for name, values in changed.items())


def check_settings(config: TrainConfig) -> None:
    """Before any worker trains: compare the resolved ``config`` with the settings saved in
    the checkpoint its run would resume from.

    Raises:
        ValueError: they differ (one line naming each setting, both values and the
            choices), and ``config.new_settings`` is not set or a setting that cannot change
            differs.
    """
    if config.save_dir is None or latest(config.save_dir) is None:
        return
    from pipetrain.checkpoint.pipeline_state import saved_extra  # loads DCP: only to resume

    found, extra = saved_extra(config.save_dir)
    saved = extra.get(SETTINGS) if isinstance(extra, dict) else None
    if not isinstance(saved, dict):
        return  # saved before runs kept their settings: nothing to compare
    changed = differences(saved, config)
    if not changed:
        return
    fixed = {name: values for name, values in changed.items() if name in FIXED}
    if fixed:
        raise ValueError(
            f"{found} was saved with {_listed(fixed, 0)}, not {_listed(fixed, 1)}, which a "
            "resumed run cannot change; give the saved values or another --save-dir"
        )
    if not config.new_settings:
        raise ValueError(
            f"{found} was saved with {_listed(changed, 0)}, not {_listed(changed, 1)}; give "
            "the saved values, --new-settings to go on with the new ones, or another --save-dir"
        )


def apply_new_settings(pipe: Pipeline, config: TrainConfig) -> bool:
    """After ``pipe`` resumed from ``config.save_dir``: with ``config.new_settings``, put
    the new learning rate into the restored optimizer and scheduler (scaling the current
    rate, so a schedule's factor is kept) and return whether the seed changed (the data
    then starts a new order); rank 0 says what changed. Without, or with nothing resumed,
    nothing changes."""
    if not config.new_settings or config.save_dir is None or latest(config.save_dir) is None:
        return False
    from pipetrain.checkpoint.pipeline_state import saved_extra  # loads DCP: only to resume

    found, extra = saved_extra(config.save_dir)
    saved = extra.get(SETTINGS) if isinstance(extra, dict) else None
    changed = differences(saved, config) if isinstance(saved, dict) else {}
    if "lr" in changed:
        old, new = changed["lr"]
        set_learning_rate(pipe, float(old), float(new))
    if changed and pipe.rank == 0:
        print(
            f"resumed from {found} with new settings: "
            + ", ".join(f"{FLAGS[name]} {old} -> {new}" for name, (old, new) in changed.items()),
            file=sys.stderr,
            flush=True,
        )
    return "seed" in changed


def set_learning_rate(pipe: Pipeline, old: float, new: float) -> None:
    """Change the base learning rate of ``pipe``'s optimizer from ``old`` to ``new``: each
    group's current rate scaled by ``new / old``, and the scheduler's base rates set."""
    optimizer = pipe.optimizer
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * new / old
        if "initial_lr" in group:
            group["initial_lr"] = new
    scheduler = pipe.lr_scheduler
    if scheduler is not None:
        scheduler.base_lrs = [new for _ in scheduler.base_lrs]
