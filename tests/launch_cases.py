"""A worker for the launcher's signal tests (importable by spawned workers), and the
launcher's command line."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pipetrain


def idle(directory: str) -> None:
    """Write this worker's PID to ``directory/RANK.pid``, then wait (far longer than a test)."""
    rank = int(os.environ["RANK"])
    (Path(directory) / f"{rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)


if __name__ == "__main__":
    pipetrain.launch(idle, 2, sys.argv[1], timeout_s=60, threads_per_worker=1)
