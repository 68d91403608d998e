"""Bad arguments and files are refused before any worker starts: status 2 and one line
naming the argument or file."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipetrain.app import cli


def refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The error line of ``pipetrain ARGS``, which must exit with status 2."""
    try:
        status = cli.main(list(args))
    except SystemExit as stop:  # argparse's refusals
        status = int(stop.code or 0)
    captured = capsys.readouterr()
    assert status == 2, captured.err
    assert "samples/s" not in captured.err, "no worker may start"
    return captured.err


def test_an_option_the_schedule_does_not_have_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    error = refused(capsys, "train", "--model", "mlp", "--schedule", "1f1b", "--vertical-sync")
    assert "1f1b has no option 'vertical_sync'" in error


def test_a_batch_larger_than_the_data_set_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    error = refused(capsys, "train", "--model", "mlp", "--batch-size", "2048")
    assert "--batch-size 2048 exceeds the 1437 digits training samples" in error


def test_a_missing_plan_file_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "plan.json"
    error = refused(capsys, "train", "--model", "mlp", "--plan", str(missing))
    assert str(missing) in error and "No such file" in error


def test_a_truncated_profile_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    truncated = tmp_path / "profile.json"
    truncated.write_text('{"format_version": 3, "layers": [{"name": "0", "forw')
    error = refused(capsys, "plan", "--profile", str(truncated), "--workers", "2")
    assert str(truncated) in error and "not valid JSON" in error


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--save-every", "5"], "--save-every needs --save-dir DIR"),
        (
            ["--save-every", "3", "--accumulate", "2", "--save-dir", "unused"],
            "--save-every 3 must be a positive multiple of --accumulate 2",
        ),
        (["--replicas", "2,2", "--ranks", "2"], "--replicas 2,2 add up to 4 ranks"),
        (["--batch-size", "3", "--microbatches", "4"], "--batch-size 3 is smaller than"),
        (["--timeout", "0"], "argument --timeout: must be greater than 0"),
        (["--keep-checkpoints", "0"], "argument --keep-checkpoints"),
    ],
)
def test_save_and_timeout_settings_that_cannot_work_are_refused(
    capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    assert expected in refused(capsys, "train", "--model", "mlp", *args)


def test_export_without_a_checkpoint_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    error = refused(capsys, "export", str(tmp_path), str(tmp_path / "model.pt"))
    assert f"no complete checkpoint in {tmp_path}" in error
