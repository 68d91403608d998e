"""No worker outlives the local launcher: SIGINT, SIGTERM and SIGKILL of the launcher end
every worker within seconds, without leaked semaphores."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import launch_cases
import pytest

import pipetrain

TESTS = Path(__file__).parent
WORKERS, LIMIT_S = 2, 10.0


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, ended but not yet reaped, is not)."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return status.rsplit(")", 1)[1].split()[0] != "Z"


def worker_pids(directory: Path, launcher: subprocess.Popen) -> list[int]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        files = [directory / f"{rank}.pid" for rank in range(WORKERS)]
        texts = [f.read_text() if f.exists() else "" for f in files]
        if all(texts):
            return [int(text) for text in texts]
        assert launcher.poll() is None, launcher.communicate()[1]
        time.sleep(0.05)
    raise AssertionError("the workers did not start within 60 s")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sent", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_every_worker_ends_soon_after_the_launcher(tmp_path: Path, sent: signal.Signals) -> None:
    launcher = subprocess.Popen(
        [sys.executable, str(TESTS / "launch_cases.py"), str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(TESTS.parent)},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pids = worker_pids(tmp_path, launcher)
        assert all(running(pid) for pid in pids)
        sent_at = time.monotonic()
        launcher.send_signal(sent)
        while any(running(pid) for pid in pids) and time.monotonic() - sent_at < LIMIT_S:
            time.sleep(0.02)
        lived = time.monotonic() - sent_at
        assert not [pid for pid in pids if running(pid)], f"workers alive {lived:.1f} s after"
        _, errors = launcher.communicate(timeout=LIMIT_S)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in pids if "pids" in locals() else []:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
    print(f"{sent.name}: workers ended {lived:.2f} s after the launcher got it")
    expected = {
        signal.SIGTERM: 128 + signal.SIGTERM,
        signal.SIGINT: -signal.SIGINT,
        signal.SIGKILL: -9,
    }
    assert launcher.returncode == expected[sent], errors
    if sent != signal.SIGKILL:  # after SIGKILL, multiprocessing's tracker frees them, warning
        assert "leaked semaphore" not in errors


def test_a_killed_worker_is_named_with_its_signal() -> None:
    with pytest.raises(
        pipetrain.LaunchError, match="worker rank 1 failed: worker was killed by SIGKILL"
    ):
        pipetrain.launch(launch_cases.killed_while_a_peer_waits, 2, timeout_s=30)
