"""``pipetrain train --ddp``: data parallelism trains as the unpipelined full-batch loop."""

from __future__ import annotations

import json

import pytest
from test_cli import run_cli, unpipelined_losses

from pipetrain.app import cli
from pipetrain.app.train_config import warmup_cosine


def test_ddp_losses_equal_the_unpipelined_loop() -> None:
    done = run_cli("train", "--model", "mlp", "--ddp", "--ranks", "2", "--steps", "3", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["schedule"] == "ddp" and report["ranks"] == 2
    assert report["samples_per_s"] == pytest.approx(report["batch_size"] / report["step_s"])
    assert report["losses"] == pytest.approx(
        unpipelined_losses("mlp", 3, report["batch_size"]), rel=1e-5
    )


@pytest.mark.slow
def test_ddp_accumulates_clips_schedules_and_evaluates_as_the_unpipelined_loop() -> None:
    # 4 workers of 8 samples: accumulation across steps without a gradient all-reduce
    done = run_cli(
        "train", "--model", "mlp", "--ddp", "--ranks", "4", "--batch-size", "32",
        "--steps", "5", "--accumulate", "2", "--max-grad-norm", "0.05",
        "--lr-schedule", "warmup-cosine", "--eval-every", "2", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    evaluations: list[dict[str, float]] = []
    expected = unpipelined_losses(
        "mlp",
        5,
        32,
        accumulate=2,
        max_grad_norm=0.05,
        factor=warmup_cosine(3),
        evaluations=evaluations,
        eval_every=2,
    )
    assert report["losses"] == pytest.approx(expected, rel=1e-5)
    assert [e["step"] for e in report["eval"]] == [2, 4]
    for got, want in zip(report["eval"], evaluations):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["accuracy"] == want["accuracy"]


@pytest.mark.parametrize(
    "args, named",
    [
        (["--batch-size", "63"], "give a --batch-size divisible by 2"),
        (["--schedule", "gpipe"], "--schedule set a pipeline, which --ddp does not run"),
        (["--balance", "2,3"], "--balance set a pipeline"),
        (["--precision", "fp16"], "--ddp trains in fp32 or bf16, not fp16"),
        (["--trace", "t.png"], "--trace draws a pipeline's last step"),
    ],
)
def test_ddp_refuses_what_only_a_pipeline_has_in_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], named: str
) -> None:
    # refused before any worker starts
    assert cli.main(["train", "--model", "mlp", "--ddp", *args]) == 2
    stderr = capsys.readouterr().err
    assert named in stderr and len(stderr.strip().splitlines()) == 1, stderr
