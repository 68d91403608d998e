"""A worker for the launcher's signal tests (importable by spawned workers), and the
launcher's command line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from pipeline_cases import batch, mlp
from settings import make_pipeline
from torch import nn

import pipetrain
from pipetrain.distributed import heartbeat
from pipetrain.distributed.torch_transport import TorchTransport
from pipetrain.distributed.transport import PeerError


def idle(directory: str) -> None:
    """Write this worker's PID to ``directory/RANK.pid``, then wait (far longer than a test)."""
    rank = int(os.environ["RANK"])
    (Path(directory) / f"{rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)


if __name__ == "__main__":
    pipetrain.launch(idle, 2, sys.argv[1], timeout_s=300, threads_per_worker=1)


Process = tuple[int, int]
"""A process as ``(pid, start time)``: PIDs wrap (at 32,768 here) and a busy machine hands
a dead worker's PID to a new process or thread within seconds, which has another start."""


def with_default_signals() -> None:
    """For ``subprocess.Popen(preexec_fn=...)``: SIGINT and SIGHUP at their default actions
    in the child. A shell starts background jobs (and ``nohup`` its command) with them
    ignored, a child inherits that, and a Python started so keeps SIGINT ignored, as the
    launcher then leaves it."""
    for number in (signal.SIGINT, signal.SIGHUP):
        signal.signal(number, signal.SIG_DFL)


def identity(pid: int) -> Process | None:
    """The live process ``pid`` now (a zombie, ended but not yet reaped, is not); Linux."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = status.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else (pid, int(fields[19]))  # state; field 22, start


def running(process: Process) -> bool:
    """Whether ``process`` is still alive (not another one given its PID since)."""
    return identity(process[0]) == process


def descendants(pid: int) -> list[Process]:
    """Every live process below ``pid`` (Linux: reads /proc)."""
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
    return [process for process in map(identity, found) if process is not None]


def killed_while_a_peer_waits() -> None:
    """Rank 1 ends by SIGKILL while rank 0 waits for a message from it."""
    if int(os.environ["RANK"]) == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.recv(torch.empty(1), src=1)


def train_until_stopped(directory: str, timeout_s: float, frozen_after_s: float) -> None:
    """Train a two-stage pipeline, writing this worker's PID to ``directory/RANK.pid`` after
    its first step, for up to a minute (until a peer is stopped and the run fails)."""
    rank = int(os.environ["RANK"])
    pipe = make_pipeline(
        mlp(),
        microbatches=2,
        loss_fn=nn.functional.cross_entropy,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
        timeout_s=timeout_s,
        frozen_after_s=frozen_after_s,
    )
    x, y = batch()
    pipe.train_step(x, y)
    (Path(directory) / f"{rank}.pid").write_text(str(os.getpid()))
    started = time.monotonic()
    while time.monotonic() - started < 60:
        pipe.train_step(x, y)


def slow_peer(delay_s: float) -> float:
    """Rank 1 computes for ``delay_s`` (its process alive and beating) before it sends; rank
    0 waits for the message. Returns what rank 0 received (rank 1: what it sent)."""
    return slow_peer_on(TorchTransport(torch.device("cpu"), timeout_s=30), delay_s)


def slow_peer_on(transport: TorchTransport, delay_s: float) -> float:
    """:func:`slow_peer` over ``transport``."""
    if int(os.environ["RANK"]) == 1:
        time.sleep(delay_s)
        transport.send((torch.full((1,), 7.0),), 0, "slow")
        transport.flush()
        return 7.0
    return float(transport.receive(1, "slow")[0])


def paused_peer(pause_s: float, timeout_s: float) -> float:
    """Rank 1 is stopped (SIGSTOP) for ``pause_s`` (a helper process continues it), then
    sends; rank 0 waits for the message with a ``timeout_s`` timeout and the default frozen
    threshold. Returns what rank 0 received (rank 1: what it sent)."""
    transport = TorchTransport(torch.device("cpu"), timeout_s=timeout_s)
    if int(os.environ["RANK"]) == 1:
        subprocess.Popen(["sh", "-c", f"sleep {pause_s}; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
        transport.send((torch.full((1,), 7.0),), 0, "paused")
        transport.flush()
        return 7.0
    return float(transport.receive(1, "paused")[0])


def stopped_past_the_timeout(timeout_s: float, pause_s: float) -> str:
    """Rank 1 is stopped (SIGSTOP) for ``pause_s``, longer than the ``timeout_s`` with
    which rank 0 waits for its message (the default frozen threshold: the waiting rank
    waits on its own thread); rank 0 returns the error its wait raised."""
    transport = TorchTransport(torch.device("cpu"), timeout_s=timeout_s)
    if int(os.environ["RANK"]) == 1:
        subprocess.Popen(["sh", "-c", f"sleep {pause_s}; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
        return ""
    try:
        transport.receive(1, "stopped")
    except PeerError as error:
        return str(error)
    return "no error"


def silent_on_another_host(frozen_after_s: float) -> str:
    """Rank 1 says it runs on another host, stops its heartbeat and stays silent while rank
    0 waits for a message from it (as a rank behind a cut link does); rank 0 returns the
    error its wait raised, rank 1 waits for rank 0 to be done."""
    transport = TorchTransport(torch.device("cpu"), timeout_s=60, frozen_after_s=frozen_after_s)
    store = dist.distributed_c10d._get_default_store()
    if int(os.environ["RANK"]) == 1:
        heartbeat.stop_beating()
        store.set("pipetrain/heartbeat/1/where", f"elsewhere.example {os.getpid()}")
        store.set("test/ready", "1")
        store.wait(["test/done"])
        return ""
    store.wait(["test/ready"])
    try:
        transport.receive(1, "never")
    except PeerError as error:
        return str(error)
    finally:
        store.set("test/done", "1")
    return "no error"
