"""A worker for the launcher's signal tests (importable by spawned workers), and the
launcher's command line."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import pipetrain


def idle(directory: str) -> None:
    """Write this worker's PID to ``directory/RANK.pid``, then wait (far longer than a test)."""
    rank = int(os.environ["RANK"])
    (Path(directory) / f"{rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)


if __name__ == "__main__":
    pipetrain.launch(idle, 2, sys.argv[1], timeout_s=60, threads_per_worker=1)


def killed_while_a_peer_waits() -> None:
    """Rank 1 ends by SIGKILL while rank 0 waits for a message from it."""
    if int(os.environ["RANK"]) == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.recv(torch.empty(1), src=1)
