"""The ``pipetrain`` command line: simulate and train output, files, and one-line errors."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.app import cli
from pipetrain.app.simulate_job import textbook_bubble
from pipetrain.schedules import build, names
from pipetrain.simulation import Costs, simulate
from pipetrain.timeline import Event, Timeline

ROOT = Path(__file__).resolve().parent.parent

SUBPROCESS_TIMEOUT_S = 540
"""A command's limit: generous, since worker processes on a machine whose cores are shared
can take minutes to start; the tests that run one get a hang timeout above it."""

pytestmark = pytest.mark.timeout(SUBPROCESS_TIMEOUT_S + 60)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m pipetrain ARGS`` from the repository root."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)  # never mistake the test run for a torchrun worker
    return subprocess.run(
        [sys.executable, "-m", "pipetrain", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=SUBPROCESS_TIMEOUT_S,
    )


def simulate_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert cli.main(["simulate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# simulate -------------------------------------------------------------------------------
def reference_costs(name: str) -> Costs:
    """The documented default costs, written out by hand."""
    if name == "zb-h1":
        return Costs(forward_s=1.0, backward_s=1.0, weight_s=1.0)
    if name in ("zb-v", "v-half", "v-min", "dualpipev", "interleaved-zb"):  # shared by 2 chunks
        return Costs(forward_s=0.5, backward_s=0.5, weight_s=0.5)
    if name in ("interleaved", "looped-bfs", "roundpipe"):  # per rank, shared by its 2 chunks
        return Costs(forward_s=0.5, backward_s=1.0)
    return Costs(forward_s=1.0, backward_s=2.0)


@pytest.mark.parametrize("name", names())
def test_simulate_json_equals_the_library(capsys: pytest.CaptureFixture[str], name: str) -> None:
    result = simulate_json(capsys, "--schedule", name, "--ranks", "4", "--microbatches", "8")
    options = {"virtual": 2} if name == "interleaved" else {}
    expected = simulate(build(name, 4, 8, **options), reference_costs(name))
    assert result["makespan"] == pytest.approx(expected.makespan)
    assert result["bubble_fraction"] == pytest.approx(expected.bubble_fraction)
    assert result["peak_activations"] == expected.peak_activations
    assert (result["schedule"], result["ranks"], result["microbatches"]) == (name, 4, 8)


def test_simulate_text_shows_the_textbook_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "8"]) == 0
    text = capsys.readouterr().out
    # by hand: makespan (m + p - 1)(F + B) = 11 * 3, bubble (p - 1)/(m + p - 1) = 3/11
    assert "33 s" in text
    assert text.count("27.3%") == 2  # simulated, and the textbook value beside it
    assert "[4, 3, 2, 1]" in text


def test_simulate_costs_file_with_per_stage_lists_and_flag_override(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    costs_file = tmp_path / "costs.json"
    costs_file.write_text(
        json.dumps(
            {"forward_s": [1, 2, 1], "backward_s": 9, "activation_bytes": 1e6, "bandwidth": 1e7}
        )
    )
    result = simulate_json(
        capsys,
        "--schedule",
        "gpipe",
        "--ranks",
        "3",
        "--microbatches",
        "5",
        "--costs",
        str(costs_file),
        "--backward",
        "2",
    )
    costs = Costs(forward_s=[1, 2, 1], backward_s=2.0, activation_bytes=1e6, bandwidth=1e7)
    expected = simulate(build("gpipe", 3, 5), costs)
    assert result["makespan"] == pytest.approx(expected.makespan)
    assert result["bubble_fraction"] == pytest.approx(expected.bubble_fraction)
    assert result["textbook_bubble_fraction"] is None  # uneven costs and transfers: no closed form


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(names()),
    p=st.integers(1, 5),
    m=st.integers(1, 10),
    costs=st.tuples(
        st.sampled_from([0.5, 1.0, 2.0]),
        st.sampled_from([0.5, 1.0, 3.0]),
        st.sampled_from([0.0, 0.5, 1.0]),
    ),
)
def test_textbook_formula_agrees_with_the_simulator_wherever_it_is_given(
    name: str, p: int, m: int, costs: tuple[float, float, float]
) -> None:
    if name == "interleaved":
        m = p * m
    if name == "2bw":
        m = max(m, p)
    if name == "dualpipev":
        m = max(m, 2 * p)
    options = {"virtual": 2} if name == "interleaved" else {}
    schedule = build(name, p, m, **options)
    forward, backward, weight = costs
    checked = Costs(forward_s=forward, backward_s=backward, weight_s=weight)
    textbook = textbook_bubble(schedule, checked)
    if textbook is not None:
        assert simulate(schedule, checked).bubble_fraction == pytest.approx(textbook[1])
    if name in ("gpipe", "1f1b", "interleaved"):
        assert textbook is not None  # uniform costs: these always have a closed form


def test_simulate_writes_png_and_chrome_trace(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    for path in (png, trace):
        assert (
            cli.main(
                [
                    "simulate",
                    "--schedule",
                    "zb-h1",
                    "--ranks",
                    "3",
                    "--microbatches",
                    "4",
                    "--out",
                    str(path),
                ]
            )
            == 0
        )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    expected = simulate(build("zb-h1", 3, 4), Costs(1.0, 1.0, 1.0))
    assert len(events) == len(expected.events)
    assert str(trace) in capsys.readouterr().out


BAD_ARGUMENTS = [
    (["simulate", "--schedule", "1f1b", "--ranks", "0", "--microbatches", "4"], "0"),
    (["simulate", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "-3"], "-3"),
    (["simulate", "--schedule", "interleaved", "--ranks", "4", "--microbatches", "6"], "6"),
    (["simulate", "--schedule", "zigzag", "--ranks", "4", "--microbatches", "8"], "zigzag"),
    (
        [
            "simulate",
            "--schedule",
            "1f1b",
            "--ranks",
            "2",
            "--microbatches",
            "2",
            "--costs",
            "no-such-file.json",
        ],
        "no-such-file.json",
    ),
    (
        [
            "simulate",
            "--schedule",
            "1f1b",
            "--ranks",
            "2",
            "--microbatches",
            "2",
            "--out",
            "timeline.svg",
        ],
        "timeline.svg",
    ),
    (
        [
            "simulate",
            "--schedule",
            "1f1b",
            "--ranks",
            "2",
            "--microbatches",
            "2",
            "--forward",
            "fast",
        ],
        "fast",
    ),
    (["train", "--model", "transformer", "--ranks", "2"], "transformer"),
    # the worker count's former name, refused naming the new one
    (["train", "--model", "mlp", "--stages", "2"], "--stages is now --ranks"),
]


@pytest.mark.parametrize(("args", "named"), BAD_ARGUMENTS)
def test_bad_arguments_give_one_line_and_status_2(args: list[str], named: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert named in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("content", "named"),
    [
        ("{not json", "not valid JSON"),
        ('{"forward": 1}', "forward_s"),
        ('{"forward_s": "slow"}', "slow"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_bad_costs_files_give_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str, named: str
) -> None:
    costs_file = tmp_path / "costs.json"
    costs_file.write_text(content)
    status = cli.main(
        [
            "simulate",
            "--schedule",
            "gpipe",
            "--ranks",
            "2",
            "--microbatches",
            "2",
            "--costs",
            str(costs_file),
        ]
    )
    error = capsys.readouterr().err
    assert status == 2
    assert len(error.strip().splitlines()) == 1
    assert named in error and str(costs_file) in error


def test_python_m_pipetrain_help_lists_the_commands() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    assert "simulate" in result.stdout and "train" in result.stdout


def test_model_choices_match_the_library() -> None:
    from pipetrain.app.models import MODEL_NAMES

    assert cli.MODEL_NAMES == MODEL_NAMES


# train ----------------------------------------------------------------------------------
def unpipelined_losses(
    model_name: str,
    steps: int,
    batch_size: int,
    accumulate: int = 1,
    max_grad_norm: float | None = None,
    factor: Callable[[int], float] | None = None,
    evaluations: list[dict[str, float]] | None = None,
    eval_every: int = 0,
) -> list[float]:
    """Losses of the same model, data and optimizer trained without a pipeline: an update
    every ``accumulate`` steps (and at the last), clipped to ``max_grad_norm``, the learning
    rate scaled by ``factor`` at each update; held-out metrics every ``eval_every`` steps
    added to ``evaluations``."""
    import torch

    from pipetrain.app.data import BatchStream
    from pipetrain.app.model_registry import model_spec
    from pipetrain.app.models import build_model, loss_function

    model = build_model(model_name, seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=model_spec(model_name).lr)
    scheduler = None if factor is None else torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    batches = BatchStream(model_name, batch_size, seed=0)
    eval_inputs, eval_targets = batches.eval_set()
    losses = []
    for step in range(steps):
        inputs, targets = next(batches)
        loss = loss_function(model_name)(model(inputs), targets)
        loss.backward()
        if (step + 1) % accumulate == 0 or step == steps - 1:
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()
        losses.append(loss.item())
        if evaluations is not None and (step + 1) % eval_every == 0:
            with torch.no_grad():
                outputs = model.eval()(eval_inputs)
            model.train()
            loss = loss_function(model_name)(outputs, eval_targets)
            evaluations.append({"step": step + 1, "loss": loss.item()})
            if isinstance(outputs, torch.Tensor):
                accuracy = float((outputs.argmax(dim=1) == eval_targets).float().mean())
                evaluations[-1]["accuracy"] = accuracy
    return losses


def test_train_json_reports_every_key_and_the_unpipelined_losses(tmp_path: Path) -> None:
    trace = tmp_path / "last-step.png"
    result = run_cli(
        "train",
        "--model",
        "mlp",
        "--ranks",
        "2",
        "--steps",
        "3",
        "--microbatches",
        "2",
        "--json",
        "--trace",
        str(trace),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    keys = {
        "losses",
        "final_loss",
        "step_s",
        "samples_per_s",
        "bubble_fraction",
        "predicted_step_s",
        "model",
        "schedule",
        "stages",
        "microbatches",
        "batch_size",
    }
    assert keys <= set(report)
    assert len(report["losses"]) == 3
    assert all(
        math.isfinite(report[k])
        for k in ("final_loss", "step_s", "samples_per_s", "bubble_fraction", "predicted_step_s")
    )
    assert report["final_loss"] == report["losses"][-1]
    assert report["samples_per_s"] == pytest.approx(report["batch_size"] / report["step_s"])
    assert report["losses"] == pytest.approx(
        unpipelined_losses("mlp", 3, report["batch_size"]), rel=1e-4
    )
    assert trace.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "step 3/3" in result.stderr  # progress, on stderr only


def test_train_accumulates_and_clips_as_the_unpipelined_loop() -> None:
    result = run_cli(
        "train",
        "--model",
        "mlp",
        "--ranks",
        "2",
        "--steps",
        "5",
        "--accumulate",
        "2",
        "--max-grad-norm",
        "0.05",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["accumulate"], report["max_grad_norm"]) == (2, 0.05)
    assert report["losses"] == pytest.approx(
        unpipelined_losses("mlp", 5, report["batch_size"], accumulate=2, max_grad_norm=0.05),
        rel=1e-4,
    )


@pytest.mark.slow  # a training run with evaluation; schedulers are checked in-process too
def test_train_follows_warmup_cosine_and_evaluates_as_the_unpipelined_loop() -> None:
    from pipetrain.app.train_config import warmup_cosine

    factor = warmup_cosine(10)
    assert factor(0) == 1.0 and factor(1) == 1.0 and 0 < factor(9) < factor(5) < 1
    assert warmup_cosine(30)(0) == pytest.approx(1 / 3)
    result = run_cli(
        "train",
        *("--model", "mlp", "--ranks", "2", "--steps", "5", "--accumulate", "2"),
        *("--lr-schedule", "warmup-cosine", "--eval-every", "2", "--json"),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["lr_schedule"], report["eval_every"]) == ("warmup-cosine", 2)
    evaluations: list[dict[str, float]] = []
    losses = unpipelined_losses(
        "mlp",
        5,
        report["batch_size"],
        accumulate=2,
        factor=warmup_cosine(3),
        evaluations=evaluations,
        eval_every=2,
    )
    assert report["losses"] == pytest.approx(losses, rel=1e-4)
    assert [e["step"] for e in report["eval"]] == [2, 4]
    for got, expected in zip(report["eval"], evaluations):
        assert got == pytest.approx(expected, rel=1e-4)
    assert "step 4/5  held-out loss" in result.stderr


def test_a_diverged_run_ends_with_status_1_naming_the_non_finite_update() -> None:
    result = run_cli("train", "--model", "mlp", "--ranks", "2", "--steps", "5", "--lr", "1e30")
    assert result.returncode == 1
    assert "NonFiniteError: non-finite values at update" in result.stderr
    assert "the update was not applied" in result.stderr


@pytest.mark.slow
def test_a_finite_but_diverged_run_reports_then_ends_with_status_1() -> None:
    result = run_cli(
        "train", *("--model", "mlp", "--ranks", "2", "--steps", "8", "--lr", "1e6", "--json")
    )
    assert result.returncode == 1
    report = json.loads(result.stdout)  # the losses are kept
    assert report["diverged"] is True
    assert report["losses"][-1] > 10 * report["losses"][0]
    assert "the run diverged: loss 2.303 at the first step" in result.stderr
    assert "--max-grad-norm" in result.stderr


@pytest.mark.slow
def test_train_in_bf16_stays_near_the_unpipelined_float32_losses() -> None:
    result = run_cli(
        "train",
        *("--model", "mlp", "--ranks", "2", "--steps", "3", "--precision", "bf16", "--json"),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["precision"], report["diverged"]) == ("bf16", False)
    expected = unpipelined_losses("mlp", 3, report["batch_size"])
    assert report["losses"] == pytest.approx(expected, rel=2e-2)
    assert report["losses"] != pytest.approx(expected, rel=1e-6), "bf16 must change the sums"


@pytest.mark.parametrize(
    ("flag", "reason"),
    [
        (("--accumulate", "2"), "so --accumulate needs a synchronous schedule"),
        (("--max-grad-norm", "1.0"), "vertical_sync"),
        (("--precision", "fp16"), "use precision='bf16'"),
    ],
)
def test_train_refuses_what_asynchronous_schedules_cannot_do_before_starting_workers(
    capsys: pytest.CaptureFixture[str], flag: tuple[str, str], reason: str
) -> None:
    assert cli.main(["train", "--model", "mlp", "--schedule", "pipedream", *flag]) == 2
    error = capsys.readouterr().err
    assert reason in error and len(error.strip().splitlines()) == 1


def test_train_rejects_a_schedule_that_cannot_split_the_batch_before_starting_workers() -> None:
    result = run_cli(
        "train",
        "--model",
        "mlp",
        "--ranks",
        "2",
        "--schedule",
        "interleaved",
        "--microbatches",
        "3",
    )
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "multiple of ranks" in result.stderr and "3" in result.stderr


# measured costs and the prediction --------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "costs"),
    [
        ("1f1b", Costs(forward_s=[1.0, 2.0, 1.5], backward_s=[2.0, 3.0, 2.5], step_s=0.5)),
        ("zb-h1", Costs(forward_s=[1.0, 2.0, 1.5], backward_s=1.0, weight_s=[0.5, 1.0, 0.5])),
        ("gpipe", Costs(forward_s=1.0, backward_s=2.0)),
    ],
)
def test_measured_costs_recover_the_costs_a_timeline_was_made_with(name: str, costs: Costs) -> None:
    from pipetrain.simulation import measured_costs

    schedule = build(name, 3, 5)
    original = simulate(schedule, costs)
    recovered = measured_costs(original, schedule.stages)
    assert simulate(schedule, recovered).makespan == pytest.approx(original.makespan)
    assert recovered.forward_s == pytest.approx(costs.per_stage("forward_s", 3))
    assert recovered.latency_s == 0.0


def test_transfer_time_counts_only_what_follows_the_send() -> None:
    from pipetrain.simulation import measured_costs, transfer_time

    events = [
        Event(0, "F", 0, 0, 0.0, 0.9),
        Event(0, "SEND_F", 0, 0, 1.0, 1.1),
        Event(1, "RECV_F", 1, 0, 0.5, 1.4),  # waited: 1.4 - 1.1 = 0.3
        Event(0, "SEND_F", 0, 1, 2.0, 2.1),
        Event(1, "RECV_F", 1, 1, 2.5, 2.6),  # data already there: its copy, 0.1
        Event(1, "SEND_B", 1, 0, 3.0, 3.05),
        Event(0, "RECV_B", 0, 0, 2.0, 3.25),  # waited: 0.2
    ]
    timeline = Timeline(events, 2)
    assert transfer_time(timeline) == pytest.approx(0.2)
    costs = measured_costs(timeline, 2)
    # a send's packing stays a send, charged to its sender apart from the compute
    assert costs.forward_s == pytest.approx([0.9, 0.0])
    assert costs.backward_s == pytest.approx([0.0, 0.0])
    assert costs.send_s == pytest.approx(0.1)  # the median of 0.1, 0.1 and 0.05
    # the copy of the shortest receive comes after a message lands, not in its latency
    assert (costs.receive_s, costs.latency_s) == pytest.approx((0.1, 0.1))


def test_progress_prints_about_every_tenth_step_when_not_on_a_terminal() -> None:
    from pipetrain.app.train_job import Progress

    stream = io.StringIO()
    progress = Progress(steps=25, batch_size=8, stream=stream)
    for step in range(1, 26):
        progress.update(step, 1.0 / step)
    lines = stream.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == [
        f"{s}/25" for s in (2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 25)
    ]
    assert "\r" not in stream.getvalue()


def test_train_report_writes_measured_chrome_trace(tmp_path: Path) -> None:
    from pipetrain.app.train_config import TrainConfig
    from pipetrain.app.train_report import TrainReport
    from pipetrain.runtime import PipelineConfig

    pipeline = PipelineConfig(microbatches=2, targets_on_first_stage=True)
    config = TrainConfig("mlp", pipeline, ranks=2, steps=4, batch_size=8, lr=1e-3).resolved()
    measured = simulate(build("1f1b", 2, 2), Costs(forward_s=[1.0, 1.5], backward_s=2.0))
    result = {
        "losses": [4.0, 3.0, 2.0, 1.0],
        "step_times_s": [9.0, 8.0, 2.0, 4.0],
        "timeline": measured.to_dict(),
    }
    report = TrainReport.build(config, result)
    assert report.step_s == 3.0  # median of the steps after the 2 warm-up steps
    assert report.to_json()["predicted_step_s"] == pytest.approx(measured.makespan)
    report.write_trace(str(tmp_path / "t.json"))
    events = [
        e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e["ph"] == "X"
    ]
    assert len(events) == len(measured.events)
    assert "4.0000 -> 1.0000" in report.summary()


def test_train_report_compares_a_plan_with_the_measured_step() -> None:
    from pipetrain.app.train_config import TrainConfig
    from pipetrain.app.train_report import TrainReport
    from pipetrain.planning import Plan, PlanStage

    plan = Plan(
        stages=[PlanStage(0, 3), PlanStage(3, 5)],
        schedule="1f1b",
        microbatches=2,
        recompute="never",
        predicted_step_s=6.0,
        predicted_throughput=4 / 6.0,
        stage_memory_bytes=[1.0, 1.0],
        ranks=2,
        microbatch_size=4,
    )
    config = TrainConfig(model="mlp", steps=4, plan=plan).resolved()
    assert (config.pipeline.balance, config.batch_size, config.planned_step_s) == ((3, 2), 8, 6.0)
    measured = simulate(build("1f1b", 2, 2), Costs(forward_s=[1.0, 1.5], backward_s=2.0))
    result = {
        "losses": [4.0, 3.0, 2.0, 1.0],
        "step_times_s": [9.0, 8.0, 2.0, 4.0],
        "timeline": measured.to_dict(),
    }
    report = TrainReport.build(config, result)
    assert report.to_json()["planned_step_s"] == 6.0
    assert "planned           6 s a step, 2.00 × the median step" in report.summary()
    # another batch size than the plan's makes its prediction moot
    assert TrainConfig(model="mlp", batch_size=16, plan=plan).resolved().planned_step_s is None


def test_interleaved_costs_per_rank_are_shared_by_its_chunks(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    costs_file = tmp_path / "costs.json"
    costs_file.write_text(json.dumps({"forward_s": [1.0, 2.0], "backward_s": 4.0}))
    result = simulate_json(
        capsys,
        "--schedule",
        "interleaved",
        "--ranks",
        "2",
        "--microbatches",
        "4",
        "--costs",
        str(costs_file),
    )
    # model stages 0..3 sit on ranks 0, 1, 0, 1; each rank's time is split over its 2 chunks
    by_model_stage = Costs(forward_s=[0.5, 1.0, 0.5, 1.0], backward_s=2.0)
    expected = simulate(build("interleaved", 2, 4, virtual=2), by_model_stage)
    assert result["makespan"] == pytest.approx(expected.makespan)


def test_zero_bubble_fills_unspecified_costs_with_ones(capsys: pytest.CaptureFixture[str]) -> None:
    result = simulate_json(
        capsys, "--schedule", "zb-h1", "--ranks", "3", "--microbatches", "6", "--forward", "2"
    )
    expected = simulate(build("zb-h1", 3, 6), Costs(forward_s=2.0, backward_s=1.0, weight_s=1.0))
    assert result["makespan"] == pytest.approx(expected.makespan)


@pytest.mark.slow
def test_train_runs_a_stock_hugging_face_model_as_the_unpipelined_one() -> None:
    pytest.importorskip("transformers")
    result = run_cli(
        "train", "--model", "hf-llama", "--ranks", "2", "--steps", "3", "--microbatches", "2",
        "--eval-every", "3", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    evaluations: list[dict[str, float]] = []
    expected = unpipelined_losses(
        "hf-llama", 3, report["batch_size"], evaluations=evaluations, eval_every=3
    )
    assert report["losses"] == pytest.approx(expected, rel=1e-4)
    assert report["eval"][0]["loss"] == pytest.approx(evaluations[0]["loss"], rel=1e-4)
