"""No worker outlives the local launcher: SIGINT, SIGTERM and SIGKILL of the launcher end
every worker, without leaked semaphores; a frozen (SIGSTOPped) worker is named, by rank, as
frozen; a stall the timeout allows is waited for; a silent peer on another host is named as
unreachable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import launch_cases
import pytest
from launch_cases import running

import pipetrain
from pipetrain.distributed import heartbeat

TESTS = Path(__file__).parent
WORKERS, LIMIT_S = 2, 300.0  # the workers end within a second; the limit only stops a hang
FROZEN_TIMEOUT_S, FROZEN_AFTER_S = 60.0, 3.0


def worker_pids(directory: Path, launcher: subprocess.Popen) -> list[int]:
    deadline = time.monotonic() + 300  # only stops a hang: a loaded machine starts workers slowly
    while time.monotonic() < deadline:
        files = [directory / f"{rank}.pid" for rank in range(WORKERS)]
        texts = [f.read_text() if f.exists() else "" for f in files]
        if all(texts):
            return [int(text) for text in texts]
        assert launcher.poll() is None, launcher.communicate()[1]
        time.sleep(0.05)
    raise AssertionError("the workers did not start within 300 s")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sent", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_every_worker_ends_soon_after_the_launcher(tmp_path: Path, sent: signal.Signals) -> None:
    launcher = subprocess.Popen(
        [sys.executable, str(TESTS / "launch_cases.py"), str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(TESTS.parent)},
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=launch_cases.with_default_signals,  # as from a terminal, whoever runs pytest
    )
    try:
        workers = [launch_cases.identity(pid) for pid in worker_pids(tmp_path, launcher)]
        assert None not in workers, "a worker ended before the signal"
        pids = launch_cases.descendants(launcher.pid)  # the workers and any helper process
        assert set(workers) <= set(pids)
        sent_at = time.monotonic()
        launcher.send_signal(sent)
        while any(map(running, pids)) and time.monotonic() - sent_at < LIMIT_S:
            time.sleep(0.02)
        lived = time.monotonic() - sent_at
        alive = [pid for pid, _ in filter(running, pids)]
        assert not alive, f"processes {alive} alive {lived:.1f} s after"
        _, errors = launcher.communicate(timeout=LIMIT_S)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for process in pids if "pids" in locals() else []:
            if running(process):
                os.kill(process[0], signal.SIGKILL)
    print(f"{sent.name}: {len(pids)} processes ended {lived:.2f} s after the launcher got it")
    expected = {
        signal.SIGTERM: 128 + signal.SIGTERM,
        signal.SIGINT: -signal.SIGINT,
        signal.SIGKILL: -9,
    }
    assert launcher.returncode == expected[sent], errors
    assert "leaked semaphore" not in errors  # multiprocessing's resource tracker's warning


def test_a_killed_worker_is_named_with_its_signal() -> None:
    with pytest.raises(
        pipetrain.LaunchError, match="worker rank 1 failed: worker was killed by SIGKILL"
    ):
        pipetrain.launch(launch_cases.killed_while_a_peer_waits, 2, timeout_s=30)


def stop_when_training(directory: Path, rank: int, stopped: dict[str, Any]) -> None:
    """Once both workers have trained a step, SIGSTOP the worker of ``rank``; record its PID
    and when it was stopped."""
    deadline = time.monotonic() + 300  # only stops a hang: a loaded machine starts workers slowly
    files = [directory / f"{r}.pid" for r in range(WORKERS)]
    while not all(f.exists() and f.read_text() for f in files):
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)
    time.sleep(0.5)  # a few steps in
    stopped["pid"] = int(files[rank].read_text())
    stopped["process"] = launch_cases.identity(stopped["pid"])
    stopped["at"] = time.monotonic()
    os.kill(int(stopped["pid"]), signal.SIGSTOP)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("frozen", [0, 1])
def test_a_stopped_worker_is_named_within_the_timeout(tmp_path: Path, frozen: int) -> None:
    stopped: dict[str, Any] = {}
    stopper = threading.Thread(target=stop_when_training, args=(tmp_path, frozen, stopped))
    stopper.start()
    try:
        with pytest.raises(pipetrain.LaunchError) as caught:
            pipetrain.launch(
                launch_cases.train_until_stopped,
                WORKERS,
                str(tmp_path),
                FROZEN_TIMEOUT_S,
                FROZEN_AFTER_S,
                timeout_s=FROZEN_TIMEOUT_S,
                threads_per_worker=1,
            )
        reported = time.monotonic()
    finally:
        stopper.join()
        if stopped.get("process") and running(stopped["process"]):
            os.kill(int(stopped["pid"]), signal.SIGCONT)
            os.kill(int(stopped["pid"]), signal.SIGKILL)
    assert "at" in stopped, f"the run failed before a worker was stopped: {caught.value}"
    took = reported - stopped["at"]
    print(f"rank {frozen} stopped: named {took:.1f} s later: {caught.value}")
    assert caught.value.rank == frozen
    assert f"worker rank {frozen} failed" in str(caught.value)
    # named as frozen by its heartbeat, not by the transfer's timeout
    assert f"rank {frozen} froze" in str(caught.value)
    assert "its process is stopped" in str(caught.value)
    assert not running(stopped["process"]), "the stopped worker was left behind"


def test_a_slow_peer_is_waited_for_not_taken_for_frozen() -> None:
    """Silent for longer than a frozen peer's heartbeat may be, but alive: no error."""
    delay_s = 12 * heartbeat.BEAT_S
    assert pipetrain.launch(launch_cases.slow_peer, WORKERS, delay_s, timeout_s=30) == [7.0, 7.0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sh and kill -CONT")
def test_a_stall_the_timeout_allows_is_waited_for() -> None:
    """A peer stopped for 4 s (no heartbeat at all) under a 60 s timeout: the run goes on;
    a fixed 3 s threshold took it for frozen."""
    got = pipetrain.launch(launch_cases.paused_peer, WORKERS, 4.0, 60.0, timeout_s=60)
    assert got == [7.0, 7.0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sh and kill -CONT")
def test_a_peer_stopped_past_the_timeout_is_named_frozen_by_default() -> None:
    """The default threshold (the timeout): the wait, on the caller's thread, ends at the
    timeout, and a peer whose heartbeat then stands still is named as stopped."""
    message = pipetrain.launch(launch_cases.stopped_past_the_timeout, WORKERS, 2.0, 8.0)[0]
    assert "rank 1 froze" in message and "its process is stopped" in message, message


def test_a_silent_peer_on_another_host_is_named_unreachable() -> None:
    message = pipetrain.launch(launch_cases.silent_on_another_host, WORKERS, 2.0, timeout_s=60)[0]
    assert "rank 1 on host elsewhere.example is unreachable" in message, message
    assert "froze" not in message


EXIT_WHILE_BEATING = """
import torch.distributed as dist
from pipetrain.distributed import heartbeat
heartbeat.BEAT_S = 0.0  # a store call at every moment, so that exit always meets one
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
heartbeat.beat()
"""


def test_a_process_exits_cleanly_while_its_heartbeat_beats() -> None:
    """A daemon thread inside a store call at interpreter exit aborts the process, which a
    restarting torchrun takes for a failed worker: the heartbeat is stopped first."""
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    ended = subprocess.run(
        [sys.executable, "-c", EXIT_WHILE_BEATING],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert ended.returncode == 0, ended.stderr
    assert "terminate called" not in ended.stderr


class _Unfinished:
    """A work not done when handed over, so that the watch passes it to its waiter thread."""

    def is_completed(self) -> bool:
        return False

    def wait(self, timeout: timedelta) -> bool:
        time.sleep(0.05)
        return True


def test_the_waiter_thread_keeps_no_work_it_has_waited_for() -> None:
    """A work the waiter still held when a watch was collected at exit was freed in that
    thread during finalization, which aborts the process ("terminate called")."""
    watch = heartbeat.Watch(timedelta(seconds=5))
    work = _Unfinished()
    held = weakref.ref(work)
    assert watch.wait(work, [])
    del work
    assert held() is None
