"""SIGKILL at every step of a checkpoint's save, and of torchrun's agent: the run restarted by
torchrun (or started again, for the agent) resumes from the newest intact checkpoint and ends
bit for bit where a run never stopped ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launch_cases import descendants, running
from test_resume import ROOT, environment, final, train

STEPS, SAVE_EVERY = 30, 10
COMMON = [
    "--ranks", "2", "--schedule", "1f1b", "--microbatches", "2", "--batch-size", "32",
    "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--keep-checkpoints", "1",
]  # fmt: skip
TRAIN = ["train", "--model", "mlp", "--json", *COMMON]
# (point of the save, before or after it, the rank killed, at which of its calls): every
# kill is in the second save, so that a checkpoint exists to resume from (and the second
# save is the first whose prune deletes one)
KILLS = [
    ("clear", "after", 0, 2),
    ("write", "before", 0, 2),
    ("write", "before", 1, 2),
    ("write", "after", 1, 2),
    ("write", "after", 0, 2),
    ("manifest", "before", 0, 2),
    ("manifest", "after", 0, 2),
    ("commit", "after", 0, 2),
    ("prune", "before", 0, 2),
    ("prune", "after", 0, 2),
]


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The run never stopped: its report and final state."""
    saves = tmp_path_factory.mktemp("whole") / "saves"
    done = subprocess.run(
        [sys.executable, "-m", "pipetrain", *TRAIN, "--save-dir", str(saves)],
        capture_output=True, text=True, cwd=ROOT, env=environment(), timeout=540,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {"report": json.loads(done.stdout.strip().splitlines()[-1]), "final": final(saves)}


def torchrun(*args: str, restarts: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", str(restarts), "--monitor-interval", "0.2", *args,
    ]  # fmt: skip


def assert_resumed_as_never_stopped(out: str, saves: Path, whole: dict) -> None:
    resumed = json.loads(out.strip().splitlines()[-1])
    assert resumed["losses"] == whole["report"]["losses"]
    got, wanted = final(saves), whole["final"]
    assert got["progress"] == wanted["progress"] == {
        "step": STEPS, "updates": STEPS, "skipped_updates": 0
    }  # fmt: skip
    for name, value in wanted["model"].items():
        assert torch.equal(got["model"][name], value), name
    for name, state in wanted["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(got["optimizer"]["state"][name][key], value), (name, key)


@pytest.mark.slow  # about 25 s a point on 2 cores
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchrun restarts, /proc")
@pytest.mark.parametrize(("point", "when", "rank", "occurrence"), KILLS)
def test_a_worker_killed_inside_a_save_resumes_bit_for_bit(
    tmp_path: Path, whole: dict, point: str, when: str, rank: int, occurrence: int
) -> None:
    saves, marker = tmp_path / "saves", tmp_path / "killed"
    worker = str(ROOT / "tests" / "kill_worker.py")
    done = subprocess.run(
        torchrun(worker, point, when, str(rank), str(occurrence), str(marker), "--",
                 *TRAIN, "--save-dir", str(saves), restarts=2),
        capture_output=True, text=True, cwd=ROOT, env=environment(), timeout=540,
    )  # fmt: skip
    assert marker.exists(), f"no worker was killed at {point} {when}: {done.stderr[-3000:]}"
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr, done.stderr[-3000:]
    assert_resumed_as_never_stopped(done.stdout, saves, whole)
    leftovers = [p.name for p in saves.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == [], leftovers


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_an_agent_killed_while_saving_leaves_a_directory_the_next_job_resumes(
    tmp_path: Path, whole: dict, capfd: pytest.CaptureFixture[str]
) -> None:
    saves = tmp_path / "saves"
    agent = subprocess.Popen(
        torchrun("-m", "pipetrain", *TRAIN, "--save-dir", str(saves), restarts=0),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, env=environment(),
    )  # fmt: skip
    deadline = time.monotonic() + 300
    try:
        # the agent dies while its workers save (a temporary directory is there), or just after
        while not any(saves.glob(".step-*")) and not any(saves.glob("step-*")):
            assert agent.poll() is None and time.monotonic() < deadline, "no save began"
            time.sleep(0.005)
        workers = descendants(agent.pid)
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        while any(map(running, workers)):
            assert time.monotonic() < deadline, "the workers outlived their agent"
            time.sleep(0.05)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    again = train(capfd, *COMMON, "--save-dir", str(saves))
    assert again.returncode == 0, again.stderr[-3000:]
    assert_resumed_as_never_stopped(again.stdout, saves, whole)
