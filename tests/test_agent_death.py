"""Workers never outlive their job under torchrun: with the agent SIGKILLed, its workers end
within seconds, before they write more than the checkpoint under way, instead of training
on into the directory that a restarted job shares."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch_cases import Process, descendants, running
from test_resume import ROOT, environment

from pipetrain import checkpoint
from pipetrain.checkpoint.directory import step_of

STEPS, SAVE_EVERY = 3000, 20
WAIT_S = 300.0  # for the first checkpoint, and for the workers to end: only stops a hang


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_end_soon_after_their_agent_is_killed(tmp_path: Path) -> None:
    saves = tmp_path / "saves"
    agent = subprocess.Popen(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "2", "--monitor-interval", "0.2",
            "-m", "pipetrain", "train", "--model", "mlp", "--ranks", "2",
            "--schedule", "1f1b", "--microbatches", "2", "--batch-size", "32",
            "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--save-dir", str(saves),
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, env=environment(),
    )  # fmt: skip
    workers: list[Process] = []
    try:
        deadline = time.monotonic() + WAIT_S
        while checkpoint.latest(saves) is None:
            assert agent.poll() is None, "the job ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within the wait"
            time.sleep(0.01)
        workers = descendants(agent.pid)
        agent.send_signal(signal.SIGKILL)
        at_kill = checkpoint.latest(saves)
        agent.wait()
        deadline = time.monotonic() + WAIT_S
        while any(map(running, workers)) and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = [pid for pid, _ in filter(running, workers)]
        assert not alive, f"workers {alive} outlived their agent by {WAIT_S:.0f} s"
    finally:
        for process in workers:
            if running(process):
                os.kill(process[0], signal.SIGKILL)
    assert at_kill is not None
    newest = checkpoint.latest(saves)
    assert newest is not None
    # at most the save under way when the agent died, never the run trained on to its end
    assert step_of(newest) <= step_of(at_kill) + SAVE_EVERY, (at_kill, newest)
