"""What a newcomer meets first: the command answers --help and bad arguments without
loading torch, every package is reachable after ``import pipetrain``, the documented lists
are the registry's, plan output speaks of one throughput, messages name flags and models,
and errors from damaged or foreign files stay one line."""

from __future__ import annotations

import json
import os
import pkgutil
import re
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from pickle import UnpicklingError

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import pipetrain
from pipetrain.app import arguments, cli, train_job
from pipetrain.app.simulate_command import add_simulate
from pipetrain.app.train_report import split_sizes
from pipetrain.app.train_resume import RunFinished
from pipetrain.planning import Plan, PlanStage, plan
from pipetrain.profiler import LayerCost, Profile, Spread
from pipetrain.schedules import build, names, spec
from pipetrain.simulation import Costs, simulate

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def python(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (nothing imported yet) from the repository root."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )


# no torch before a command runs ----------------------------------------------------------
NO_TORCH_ARGUMENTS = [
    ["--help"],
    ["train", "--help"],
    ["plan", "--help"],
    ["train", "--model", "mlp", "--no-such-flag"],
    ["train", "--model", "mlp", "--steps", "zero"],
    ["train", "--model", "mlp", "--stages", "2"],
    ["train", "--model", "mlp", "--save-every", "5"],
    ["simulate", "--schedule", "1f1b"],
]


def test_help_and_argument_errors_load_no_torch() -> None:
    done = python(
        "import sys\n"
        "import pipetrain\n"
        "from pipetrain.app import cli\n"
        f"for argv in {NO_TORCH_ARGUMENTS!r}:\n"
        "    try:\n"
        "        status = cli.main(argv)\n"
        "    except SystemExit as stop:\n"
        "        status = stop.code\n"
        "    print('status', status, file=sys.stderr)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    # every one answered: --help with 0, the bad arguments with 2
    assert re.findall(r"^status (\S+)$", done.stderr, re.M) == ["0"] * 3 + ["2"] * 5
    assert "--stages is now --ranks" in done.stderr
    assert "--save-every needs --save-dir" in done.stderr


# every package after `import pipetrain` --------------------------------------------------
def test_every_package_is_an_attribute_after_import_pipetrain_which_loads_no_torch() -> None:
    on_disk = {
        module.name
        for module in pkgutil.iter_modules(pipetrain.__path__)
        if module.name not in ("__main__", "app")  # the command's, imported by name
    }
    assert set(pipetrain.SUBPACKAGES) == on_disk
    done = python(
        "import sys\n"
        "import pipetrain\n"
        "print('torch' in sys.modules)\n"
        f"for name in {sorted(on_disk)!r}:\n"
        "    assert getattr(pipetrain, name).__name__ == 'pipetrain.' + name\n"
        "pipetrain.runtime.keep_freed_memory()\n"
        "print(pipetrain.checkpoint.latest('no-such-directory'))\n"
        "print(pipetrain.model.StageModule.__name__)\n"
        "print(pipetrain.distributed.launch.launch.__name__)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "None", "StageModule", "launch"]


# lists from the registry -----------------------------------------------------------------
def test_the_readme_and_the_package_list_every_registered_schedule() -> None:
    paragraph = README[
        README.index("Schedule names:") : README.index("`pipetrain.schedules.names()` lists")
    ]
    listed = [
        token for token in re.findall(r"`([^`]+)`", paragraph) if re.fullmatch(r"[a-z0-9-]+", token)
    ]
    # pipetrain's own families (another test module registers one of its own on import)
    builtin = [name for name in names() if spec(name).generate.__module__.startswith("pipetrain.")]
    assert sorted(listed) == sorted(builtin)
    documented = re.findall(r"``([a-z0-9-]+)``", pipetrain.__doc__ or "")
    assert set(builtin) <= set(documented)
    for name in builtin:  # the timelines table has a chart of each
        assert f"docs/timelines/{name}.png" in README


def test_the_readme_states_zero_bubbles_extra_activations_as_simulated() -> None:
    stated = re.search(r"ZB-H1 holds\s+`(\[[\d, ]+\])` .* 1F1B's `(\[[\d, ]+\])`", README, re.S)
    costs = Costs(forward_s=1.0, backward_s=1.0, weight_s=1.0)
    for name, peaks in (("zb-h1", stated.group(1)), ("1f1b", stated.group(2))):
        timeline = simulate(build(name, ranks=4, microbatches=8), costs)
        assert str(timeline.peak_activations) == peaks


def test_plan_help_states_the_schedules_the_planner_tries(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    text = "".join(capsys.readouterr().out.split())  # help wraps lines, at hyphens too
    tried = ",".join(name for name in names() if spec(name).planned_by_default)
    assert f"(default{tried})" in text


# plan output: one throughput scale -------------------------------------------------------
def test_plan_progress_rejections_and_headline_share_the_steady_scale() -> None:
    layers = [LayerCost(forward_s=1.0, backward_s=2.0, activation_bytes=1e3) for _ in range(6)]
    slow_runs = Spread(
        [[2 * layer.forward_s for layer in layers]] * 3,
        [[2 * layer.backward_s for layer in layers]] * 3,
    )
    lines: list[str] = []
    chosen = plan(
        Profile(layers, spread=slow_runs), workers=3, microbatches=(4, 8), progress=lines.append
    )
    figures = [line for line in [*lines, *chosen.rejected.values()] if "samples/s" in line]
    assert figures and all("samples/s steady" in line for line in figures)
    best = [line for line in lines if "best so far" in line][-1]
    best_figure = float(re.search(r"([\d.e+]+) samples/s steady", best).group(1))
    headline = chosen.describe().splitlines()[1]
    steady = float(
        re.search(
            r"median time, the scale candidates are compared on\): \S+ s, ([\d.e+]+) samples/s",
            headline,
        ).group(1)
    )
    assert steady == pytest.approx(best_figure, rel=1e-3)
    # the varied prediction doubles every action here, so it halves the throughput
    assert chosen.predicted_throughput == pytest.approx(steady / 2, rel=1e-3)


def test_progress_lines_come_at_most_once_a_second_and_never_twice(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = [100.0]
    monkeypatch.setattr(arguments.time, "monotonic", lambda: clock[0])
    report = arguments.progress_printer(quiet_s=1.0)
    for at, line in [
        (100.5, "a"),
        (101.0, "b"),
        (101.5, "c"),
        (102.1, "c"),
        (103.2, "c"),
        (103.3, "d"),
        (104.3, "e"),
    ]:
        clock[0] = at
        report(line)
    assert capsys.readouterr().err.split() == ["b", "c", "d", "e"]


# words, numbers and flags ----------------------------------------------------------------
@pytest.mark.parametrize("samples, parts", [(16, 4), (10, 4), (4, 4), (7, 1), (3, 2)])
def test_micro_batch_sizes_are_whole_samples_as_the_pipeline_splits_them(
    samples: int, parts: int
) -> None:
    sizes = sorted({len(chunk) for chunk in torch.tensor_split(torch.arange(samples), parts)})
    expected = "-".join(str(size) for size in sizes)
    noun = "micro-batch" if parts == 1 else "micro-batches"
    unit = "sample" if expected == "1" else "samples"
    assert split_sizes(samples, parts) == f"{parts} {noun} of {expected} {unit}"


def a_plan(model: str) -> Plan:
    return Plan(
        stages=[PlanStage(0, 3), PlanStage(3, 5)],
        schedule="1f1b",
        microbatches=4,
        recompute="never",
        predicted_step_s=1.0,
        predicted_throughput=64.0,
        stage_memory_bytes=[0.0, 0.0],
        ranks=2,
        microbatch_size=16,
        model=model,
    )


def test_a_plan_for_another_model_is_refused_naming_both(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    saved = tmp_path / "plan.json"
    a_plan("gpt").save(saved)
    assert cli.main(["train", "--model", "mlp", "--plan", str(saved)]) == 2
    error = capsys.readouterr().err
    assert "the plan was made for --model gpt, not mlp" in error


def test_profiles_and_plans_keep_the_model_they_were_made_for(tmp_path: Path) -> None:
    profile = Profile([LayerCost(1.0, 2.0) for _ in range(4)], model="uneven-mlp")
    profile.save(tmp_path / "profile.json")
    loaded = Profile.load(tmp_path / "profile.json")
    assert loaded.model == "uneven-mlp"
    assert plan(loaded, workers=2).model == "uneven-mlp"
    a_plan("gpt").save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").model == "gpt"


# errors from damaged or foreign files stay one line -------------------------------------
def test_deeply_nested_json_is_refused_naming_the_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    nested = tmp_path / "profile.json"
    nested.write_text("[" * 100_000 + "]" * 100_000)
    assert cli.main(["plan", "--profile", str(nested), "--workers", "2"]) == 2
    assert f"the profile {nested} nests its JSON too deeply" in capsys.readouterr().err
    costs = tmp_path / "costs.json"
    costs.write_text("[" * 100_000 + "]" * 100_000)
    args = ["simulate", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2"]
    assert cli.main([*args, "--costs", str(costs)]) == 2
    assert "nests its JSON too deeply" in capsys.readouterr().err


def failing_with(error: BaseException) -> tuple:
    def run(args: object) -> None:
        raise error

    return (add_simulate, run)


@pytest.mark.parametrize(
    "error, expected",
    [
        (
            UnpicklingError("pickle data was truncated"),
            "UnpicklingError: pickle data was truncated",
        ),
        (KeyError("data"), "KeyError: 'data'"),
        (
            CheckpointException("failed", {1: (ValueError("bad entry"), traceback.StackSummary())}),
            "checkpoint failed on rank 1: ValueError: bad entry",
        ),
        (RuntimeError("x" * 10_000), "(8,000 characters more)"),
    ],
)
def test_errors_from_damaged_files_exit_1_with_one_line(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    error: BaseException,
    expected: str,
) -> None:
    monkeypatch.setitem(cli.COMMANDS, "simulate", failing_with(error))
    assert cli.main(["simulate", "--schedule", "1f1b"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pipetrain simulate: failed: ")
    assert expected in err


def test_a_finished_run_restarted_still_prints_its_json(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def finished(config: object) -> None:
        raise RunFinished("ckpt/step-00000020", 20)

    monkeypatch.setattr(train_job, "run_training", finished)
    assert cli.main(["train", "--model", "mlp", "--steps", "20", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {
        "finished_before": True,
        "checkpoint": "ckpt/step-00000020",
        "steps": 20,
    }
    assert "had finished before this restart" in captured.err


def test_plan_counts_ranks_as_train_does_and_still_reads_workers(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    profile = tmp_path / "profile.json"
    Profile([LayerCost(1.0, 2.0) for _ in range(4)], model="mlp").save(profile)
    plans = []
    for flag in ("--ranks", "--workers"):
        assert cli.main(["plan", "--profile", str(profile), flag, "2", "--json"]) == 0
        plans.append(json.loads(capsys.readouterr().out))
    assert plans[0] == plans[1] and plans[0]["ranks"] == 2 and plans[0]["model"] == "mlp"
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    usage = capsys.readouterr().out
    assert "--ranks N" in usage and "--workers" not in usage


def test_the_launcher_ticks_while_the_ranks_start_and_end_but_not_while_rank_0_talks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    phases = []
    asked = threading.Event()

    def phase() -> str | None:
        said = train_job._launch_phase(str(tmp_path))
        phases.append(said)
        if len(phases) >= 3:
            asked.set()
        return said

    def through(event: str | None) -> None:
        phases.clear()
        asked.clear()
        if event is not None:
            (tmp_path / event).touch()
        with arguments.ticking(phase, every_s=0.01):
            assert asked.wait(600)  # only stops a hang

    through(None)
    assert set(phases) == {"starting"}
    through("started")
    assert set(phases) == {None}
    through("finished")
    assert set(phases) == {"ending the ranks"}
    lines = capsys.readouterr().err.splitlines()
    assert any(line.startswith("starting: ") for line in lines)
    assert any(line.startswith("ending the ranks: ") for line in lines)
