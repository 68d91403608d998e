"""`pipetrain profile`, `plan`, and `train` with plans, replicas and asynchronous schedules."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cli import ROOT, SUBPROCESS_TIMEOUT_S, run_cli

import pipetrain
from pipetrain.app.plan_job import plan_together, profile_builtin, profile_together
from pipetrain.planning import Plan
from pipetrain.profiler import Profile
from pipetrain.units import parse_bytes

# worker processes on a machine whose cores are shared can take minutes to start and
# finish: each test's hang timeout is generous and the subprocess limits sit below it
pytestmark = pytest.mark.timeout(SUBPROCESS_TIMEOUT_S + 60)


def last_json(output: str) -> dict:
    return json.loads(output.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def mlp_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profile") / "mlp.json"
    done = run_cli(
        "profile",
        "--model",
        "mlp",
        "--batch-size",
        "32",
        "--microbatches",
        "2",
        "-o",
        str(path),
        "--json",
    )
    assert done.returncode == 0, done.stderr
    printed = last_json(done.stdout)
    assert len(printed["layers"]) == 5
    assert Profile.load(path).microbatch_size == 16
    return path


def test_profile_measures_every_layer(mlp_profile: Path) -> None:
    profile = Profile.load(mlp_profile)
    linear_bytes = [(64 * 128 + 128) * 4, 0, (128 * 128 + 128) * 4, 0, (128 * 10 + 10) * 4]
    assert [layer.parameter_bytes for layer in profile.layers] == linear_bytes
    assert all(layer.forward_s > 0 and layer.backward_s > 0 for layer in profile.layers)
    assert all((layer.optimizer_s > 0) == (layer.parameter_bytes > 0) for layer in profile.layers)


def test_plan_prints_a_plan_and_saves_it(mlp_profile: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    done = run_cli(
        "plan",
        "--profile",
        str(mlp_profile),
        "--workers",
        "2",
        "--batch-size",
        "32",
        "--no-replication",
        "-o",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    plan = Plan.load(out)
    assert plan.ranks == 2 and sum(plan.balance) == 5 and plan.replicas == [1] * len(plan.stages)
    assert f"predicted step {plan.predicted_step_s:.4g} s" in done.stdout


def test_plan_memory_error_names_the_smallest_fit(mlp_profile: Path) -> None:
    done = run_cli("plan", "--profile", str(mlp_profile), "--workers", "2", "--memory", "1kB")
    assert done.returncode == 2
    assert "no candidate plan fits a memory limit of 1 kB a rank" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_train_follows_a_saved_plan(mlp_profile: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    assert (
        run_cli(
            "plan",
            "--profile",
            str(mlp_profile),
            "--workers",
            "2",
            "--batch-size",
            "32",
            "--no-replication",
            "--schedules",
            "gpipe",
            "-o",
            str(out),
        ).returncode
        == 0
    )
    done = run_cli("train", "--model", "mlp", "--plan", str(out), "--steps", "3", "--json")
    assert done.returncode == 0, done.stderr
    report = last_json(done.stdout)
    plan = Plan.load(out)
    assert report["schedule"] == "gpipe" and report["microbatches"] == plan.microbatches
    assert len(report["losses"]) == 3 and all(math.isfinite(x) for x in report["losses"])


@pytest.mark.parametrize(
    "extra",
    [
        ["--schedule", "pipedream", "--microbatches", "4"],
        pytest.param(["--schedule", "pipedream", "--vertical-sync"], marks=pytest.mark.slow),
        pytest.param(["--schedule", "2bw", "--microbatches", "2"], marks=pytest.mark.slow),
    ],
)
def test_train_runs_asynchronous_schedules(extra: list[str]) -> None:
    done = run_cli(
        "train", "--model", "mlp", "--steps", "3", "--batch-size", "32", "--json", *extra
    )
    assert done.returncode == 0, done.stderr
    report = last_json(done.stdout)
    assert len(report["losses"]) == 3 and report["predicted_step_s"] > 0


def run_torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "pipetrain",
        *args,
    ]
    # torchrun --standalone picks a free port and binds it later; on a machine busy with
    # other test processes that port is occasionally taken in between, so allow a new try
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
    for _ in range(3):
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=max(1.0, deadline - time.monotonic()),
        )
        if done.returncode == 0:
            break
    return done


@pytest.mark.slow  # torchrun with 4 workers
def test_replicated_plan_runs_under_torchrun() -> None:
    done = run_torchrun(
        3,
        "train",
        "--model",
        "mlp",
        "--replicas",
        "2,1",
        "--balance",
        "3,2",
        "--steps",
        "3",
        "--json",
    )
    assert done.returncode == 0, done.stderr[:6000]
    report = last_json(done.stdout)
    assert report["ranks"] == 3 and len(report["losses"]) == 3


@pytest.mark.parametrize(
    "text, expected",
    [("16GiB", 16 * 1024**3), ("500MB", 5e8), ("1024", 1024.0), ("1.5kB", 1500.0), ("1e9", 1e9)],
)
def test_memory_sizes_parse(text: str, expected: float) -> None:
    assert parse_bytes(text) == expected


def test_a_bad_memory_size_is_named() -> None:
    with pytest.raises(ValueError, match="memory size '16 gigs' is not a size"):
        parse_bytes("16 gigs")


@pytest.mark.parametrize(
    ("model", "torchrun"),
    [
        ("mlp", False),
        ("mlp", True),
        pytest.param("hf-gpt2", False, marks=pytest.mark.slow),  # captured as a graph
    ],
)
def test_train_plan_auto_profiles_plans_and_trains(model: str, torchrun: bool) -> None:
    # under torchrun the ranks profile together and rank 0's plan reaches every rank
    args = (
        "train",
        "--model",
        model,
        "--plan",
        "auto",
        "--steps",
        "3",
        "--batch-size",
        "32",
        "--json",
    )
    done = run_torchrun(2, *args) if torchrun else run_cli(*args)
    assert done.returncode == 0, done.stderr[:6000]
    report = last_json(done.stdout)
    assert report["batch_size"] == 32 and report["ranks"] == 2
    assert len(report["losses"]) == 3 and all(math.isfinite(x) for x in report["losses"])
    assert report["planned_step_s"] > 0
    assert "predicted step" in done.stderr  # the plan is shown before training


@pytest.mark.slow  # workers profiling together; the default suite keeps train --plan auto
def test_workers_profile_together_and_share_one_plan() -> None:
    [pooled_profile, nothing] = pipetrain.launch(
        profile_together, 2, "mlp", 32, 2, 0, 1, 6, math.inf, [4]
    )
    alone = profile_builtin("mlp", 32, 2, repeats=6)
    assert nothing is None
    assert [layer.activation_bytes for layer in pooled_profile.layers] == [
        layer.activation_bytes for layer in alone.layers
    ]
    assert len(alone.spread.forward_s) == 6
    assert (
        len(pooled_profile.spread.forward_s) == len(pooled_profile.spread.backward_s) == 2 * 6
    )  # both workers' runs
    assert pooled_profile.message_s > 0 and alone.message_s == 0
    if len(os.sched_getaffinity(0)) >= 2:  # a core each: no slowdown to measure
        assert pooled_profile.shared_cores_factor == 1.0
    # also measured at 4 micro-batches of 8, both workers' runs pooled
    [at_8] = pooled_profile.other_sizes
    assert at_8.microbatch_size == 8 and len(at_8.spread.forward_s) == 2 * 6
    plans = pipetrain.launch(plan_together, 2, "mlp", 32)
    assert plans[0] == plans[1] and plans[0].ranks == 2 and plans[0].batch_size == 32


def test_a_plan_and_plan_auto_together_are_refused(mlp_profile: Path) -> None:
    from pipetrain.app.train_config import TrainConfig

    chosen = pipetrain.plan(Profile.load(mlp_profile), workers=2)
    with pytest.raises(ValueError, match="a plan or plan_auto=True, not both"):
        TrainConfig("mlp", plan=chosen, plan_auto=True).resolved()
