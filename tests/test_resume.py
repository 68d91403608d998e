"""``pipetrain train --save-dir``: a worker killed mid-run under torchrun with restarts, and
the resumed run's losses and final weights equal those of a run that was never stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from launch_cases import descendants

from pipetrain import checkpoint
from pipetrain.app import cli
from pipetrain.app.data import BatchStream

ROOT = Path(__file__).resolve().parent.parent
STEPS, SAVE_EVERY = 120, 10
TRAIN = [
    "train",
    "--model", "mlp",
    "--ranks", "2",
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


def worker(agent: int, rank: int) -> int | None:
    """The PID of torchrun's worker of ``rank``, if it runs."""
    for pid, _ in descendants(agent):
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


@dataclass
class Run:
    """What ``pipetrain ARGS`` did: its exit status and what it and its workers wrote."""

    returncode: int
    stdout: str
    stderr: str


def pipetrain_command(capfd: pytest.CaptureFixture[str], *args: str) -> Run:
    """``pipetrain ARGS`` in this process (its workers are new processes, as from a shell),
    which spares the test a Python and torch start per run."""
    capfd.readouterr()
    status = cli.main(list(args))
    out, err = capfd.readouterr()
    return Run(status, out, err)


def train(capfd: pytest.CaptureFixture[str], *args: str) -> Run:
    """``pipetrain train --model mlp --json ARGS`` on local workers."""
    return pipetrain_command(capfd, "train", "--model", "mlp", "--json", *args)


def losses(run: Run) -> list[float]:
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])["losses"]


@pytest.mark.slow  # 17 s alone, up to 30 s on 2 busy cores
def test_a_run_started_again_goes_on_from_its_newest_checkpoint(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The uninterrupted run goes on in another process while the first part runs here."""
    common = ["--schedule", "gpipe", "--microbatches", "2", "--batch-size", "16"]
    with (tmp_path / "whole.out").open("w") as out:
        uninterrupted = subprocess.Popen(
            [sys.executable, "-m", "pipetrain", "train", "--model", "mlp", "--json", *common,
             "--steps", "9"],
            stdout=out, stderr=subprocess.DEVNULL, cwd=ROOT, env=environment(),
        )  # fmt: skip
    saves = str(tmp_path / "saves")
    try:
        first = losses(
            train(capfd, *common, "--steps", "6", "--save-dir", saves, "--save-every", "3")
        )
    finally:
        assert uninterrupted.wait(timeout=120) == 0
    whole = losses(Run(0, (tmp_path / "whole.out").read_text(), ""))
    assert [p.name for p in checkpoint.checkpoints(saves)] == ["step-00000003", "step-00000006"]
    again = train(capfd, *common, "--steps", "9", "--save-dir", saves, "--keep-checkpoints", "1")
    assert "after step 6" in again.stderr
    assert first == whole[:6] and losses(again) == whole
    assert [p.name for p in checkpoint.checkpoints(saves)] == ["step-00000009"]
    done = train(capfd, *common, "--steps", "9", "--save-dir", saves)
    assert done.returncode == 2 and "nothing is left to train" in done.stderr
    assert "samples/s" not in done.stderr, "no worker may start"
    # torchrun restarting a worker that died after the final save: the run is complete
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
        restarted = train(capfd, *common, "--steps", "9", "--save-dir", saves)
        beyond = train(capfd, *common, "--steps", "8", "--save-dir", saves)
    assert restarted.returncode == 0 and "had finished before this restart" in restarted.stderr
    assert "samples/s" not in restarted.stderr, "no worker may start"
    assert beyond.returncode == 2 and "nothing is left to train" in beyond.stderr


def final(save_dir: Path) -> dict:
    path = save_dir / "final.pt"
    checkpoint.export(save_dir, path)
    return torch.load(path, weights_only=False)


def kill_at_first_checkpoint(
    agent: subprocess.Popen[bytes], saves: Path, killed: dict[str, Path | None]
) -> None:
    """SIGKILL torchrun's worker of rank 1 as soon as a checkpoint appears in ``saves``;
    record the newest checkpoint right after."""
    deadline = time.monotonic() + 90
    while checkpoint.latest(saves) is None:
        if agent.poll() is not None or time.monotonic() > deadline:
            return
        time.sleep(0.01)
    victim = worker(agent.pid, 1)
    if victim is not None:
        os.kill(victim, signal.SIGKILL)
        killed["after"] = checkpoint.latest(saves)


@pytest.mark.slow  # 18 s alone, up to 35 s on 2 busy cores
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_worker_resumes_under_torchrun_as_if_never_stopped(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The uninterrupted run goes on in this process while torchrun's runs."""
    saves, logs = tmp_path / "killed", {name: tmp_path / f"agent.{name}" for name in ("out", "err")}
    with logs["out"].open("w") as out, logs["err"].open("w") as err:
        agent = subprocess.Popen(
            [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "--max-restarts", "3", "--monitor-interval", "0.2",
                "-m", "pipetrain", *TRAIN, "--save-dir", str(saves),
            ],
            stdout=out, stderr=err, cwd=ROOT, env=environment(),
        )  # fmt: skip
    killed: dict[str, Path | None] = {}
    killer = threading.Thread(target=kill_at_first_checkpoint, args=(agent, saves, killed))
    killer.start()
    try:
        whole = pipetrain_command(capfd, *TRAIN, "--save-dir", str(tmp_path / "whole"))
        killer.join()
        agent.wait(timeout=150)
    finally:
        killer.join()
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    agent_out, agent_err = logs["out"].read_text(), logs["err"].read_text()
    assert whole.returncode == 0, whole.stderr
    assert "after" in killed, f"no worker was killed: {agent_err}"
    assert agent.returncode == 0, agent_err
    assert "resumed from" in agent_err, f"the run ended before the kill ({killed}): {agent_err}"
    resumed = json.loads(agent_out.strip().splitlines()[-1])
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
