"""A run resumed with other settings than its checkpoint's: refused naming each, or, with
``--new-settings``, trained with the new ones (the optimizer's learning rate too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_resume import Run, train

from pipetrain import checkpoint
from pipetrain.checkpoint.entries import OPTIMIZER_GROUP, read_everything

COMMON = ["--ranks", "2", "--schedule", "gpipe", "--microbatches", "2"]
SAVED = ["--lr", "0.003", "--batch-size", "16", "--seed", "0"]
CHANGED = ["--lr", "0.1", "--batch-size", "32", "--seed", "7"]


def learning_rates(save_dir: Path) -> set[float]:
    """The learning rates of the optimizer groups in the newest checkpoint."""
    newest = checkpoint.latest(save_dir)
    assert newest is not None
    saved = read_everything(newest)
    return {entry["lr"] for key, entry in saved.items() if key.startswith(OPTIMIZER_GROUP)}


def report(run: Run) -> dict:
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # three short runs of two workers
def test_other_settings_are_refused_or_applied_when_asked(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    saves = tmp_path / "saves"
    first = train(capfd, *COMMON, *SAVED, "--steps", "2", "--save-dir", str(saves))
    assert report(first)["lr"] == 0.003
    assert learning_rates(saves) == {0.003}

    refused = train(capfd, *COMMON, *CHANGED, "--steps", "4", "--save-dir", str(saves))
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    for named in ("--lr 0.003", "--batch-size 16", "--seed 0", "--lr 0.1", "--batch-size 32"):
        assert named in lines[0]
    assert "--seed 7" in lines[0] and "--new-settings" in lines[0]
    assert "samples/s" not in refused.stderr, "no worker may start"

    applied = train(
        capfd, *COMMON, *CHANGED, "--steps", "4", "--save-dir", str(saves), "--new-settings"
    )
    resumed = report(applied)
    assert "after step 2" in applied.stderr and "--lr 0.003 -> 0.1" in applied.stderr
    assert resumed["lr"] == 0.1 and resumed["batch_size"] == 32
    # the optimizer trained at the new rate: its saved groups say so, not the old 0.003
    assert learning_rates(saves) == {0.1}


@pytest.mark.slow
def test_the_learning_rate_schedule_cannot_change_even_when_asked(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    saves = tmp_path / "saves"
    assert train(capfd, *COMMON, "--steps", "2", "--save-dir", str(saves)).returncode == 0
    changed = train(
        capfd, *COMMON, "--steps", "4", "--save-dir", str(saves), "--new-settings",
        "--lr-schedule", "warmup-cosine",
    )  # fmt: skip
    assert changed.returncode == 2, changed.stderr
    assert "--lr-schedule constant, not --lr-schedule warmup-cosine" in changed.stderr
    assert "cannot change" in changed.stderr
