"""``pipetrain train --save-dir``: a worker killed mid-run under torchrun with restarts, and
the resumed run's losses and final weights equal those of a run that was never stopped."""

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

from pipetrain import checkpoint
from pipetrain.app.data import BatchStream

ROOT = Path(__file__).resolve().parent.parent
STEPS, SAVE_EVERY = 120, 10
TRAIN = [
    "train",
    "--model", "mlp",
    "--stages", "2",
    "--schedule", "1f1b",
    "--microbatches", "2",
    "--batch-size", "32",
    "--steps", str(STEPS),
    "--save-every", str(SAVE_EVERY),
    "--json",
]  # fmt: skip


def environment() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # a restarted group must not meet the previous attempt's addresses in a shared store
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def worker(agent: int, rank: int) -> int | None:
    """The PID of torchrun's worker of ``rank``, if it runs."""
    for pid in descendants(agent):
        try:
            variables = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in variables:
            return pid
    return None


@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_a_batch_stream_goes_on_from_a_saved_position(model: str) -> None:
    stream = BatchStream(model, 700 if model == "mlp" else 4, seed=3)
    for _ in range(3):  # into the second epoch of the digits
        next(stream)
    state = stream.state_dict()
    expected = [next(stream) for _ in range(2)]
    again = BatchStream(model, 700 if model == "mlp" else 4, seed=3)
    again.load_state_dict(state)
    for (x, y), (want_x, want_y) in zip((next(again) for _ in range(2)), expected):
        assert torch.equal(x, want_x) and torch.equal(y, want_y)


def train(*args: str) -> subprocess.CompletedProcess[str]:
    """``pipetrain train ARGS`` on local workers."""
    return subprocess.run(
        [sys.executable, "-m", "pipetrain", "train", "--model", "mlp", "--json", *args],
        capture_output=True, text=True, cwd=ROOT, env=environment(), timeout=120,
    )  # fmt: skip


def losses(run: subprocess.CompletedProcess[str]) -> list[float]:
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])["losses"]


@pytest.mark.slow
def test_a_run_started_again_goes_on_from_its_newest_checkpoint(tmp_path: Path) -> None:
    common = ["--schedule", "gpipe", "--microbatches", "2", "--batch-size", "16"]
    whole = losses(train(*common, "--steps", "9"))
    saves = str(tmp_path / "saves")
    first = losses(train(*common, "--steps", "6", "--save-dir", saves, "--save-every", "3"))
    assert [p.name for p in checkpoint.checkpoints(saves)] == ["step-00000003", "step-00000006"]
    again = train(*common, "--steps", "9", "--save-dir", saves, "--keep-checkpoints", "1")
    assert "after step 6" in again.stderr
    assert first == whole[:6] and losses(again) == whole
    assert [p.name for p in checkpoint.checkpoints(saves)] == ["step-00000009"]
    done = train(*common, "--steps", "9", "--save-dir", saves)
    assert done.returncode == 2 and "nothing is left to train" in done.stderr
    assert "samples/s" not in done.stderr, "no worker may start"


def final(save_dir: Path) -> dict:
    path = save_dir / "final.pt"
    checkpoint.export(save_dir, path)
    return torch.load(path, weights_only=False)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_worker_resumes_under_torchrun_as_if_never_stopped(tmp_path: Path) -> None:
    whole = subprocess.run(
        [sys.executable, "-m", "pipetrain", *TRAIN, "--save-dir", str(tmp_path / "whole")],
        capture_output=True, text=True, cwd=ROOT, env=environment(), timeout=120,
    )  # fmt: skip
    assert whole.returncode == 0, whole.stderr
    saves = tmp_path / "killed"
    agent = subprocess.Popen(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "2", "--max-restarts", "3", "--monitor-interval", "0.2",
            "-m", "pipetrain", *TRAIN, "--save-dir", str(saves),
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=environment(),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while checkpoint.latest(saves) is None:
            assert agent.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.01)
        victim = worker(agent.pid, 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        killed_after = checkpoint.latest(saves)
        out, err = agent.communicate(timeout=150)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert agent.returncode == 0, err
    assert "resumed from" in err, f"the run ended before the kill ({killed_after}): {err}"
    resumed = json.loads(out.strip().splitlines()[-1])
    expected = json.loads(whole.stdout.strip().splitlines()[-1])
    assert resumed["losses"] == expected["losses"]
    got, wanted = final(saves), final(tmp_path / "whole")
    assert (
        got["progress"]
        == wanted["progress"]
        == {"step": STEPS, "updates": STEPS, "skipped_updates": 0}
    )
    for name, value in wanted["model"].items():
        assert torch.equal(got["model"][name], value), name
    for name, state in wanted["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(got["optimizer"]["state"][name][key], value), (name, key)
