"""A torchrun worker that SIGKILLs itself once at one point of a checkpoint's save, then runs
``pipetrain`` as usual (a restarted worker finds the marker file and does not kill again).

    torchrun ... tests/kill_worker.py POINT WHEN RANK OCCURRENCE MARKER -- pipetrain-args...

POINT is a step of a save (``clear``, ``write``, ``manifest``, ``commit``, ``prune``), WHEN
``before`` or ``after`` it, on worker RANK, at its OCCURRENCE-th call.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pipetrain.checkpoint.manifest as manifest
import pipetrain.checkpoint.pipeline_state as pipeline_state
from pipetrain.app import cli

POINTS: dict[str, tuple[Any, str]] = {
    "clear": (pipeline_state, "clear_temporary"),  # the lock and leftovers, before writing
    "write": (pipeline_state, "write"),  # every rank's entries (DCP)
    "manifest": (manifest, "write"),  # the sizes and checksums, before the rename
    "commit": (pipeline_state, "commit"),  # manifest, rename, directory sync
    "prune": (pipeline_state, "prune"),  # older checkpoints deleted
}


def armed(original: Callable[..., Any], when: str, occurrence: int, marker: Path) -> Any:
    """``original``, killing this process before or after its ``occurrence``-th call."""
    calls = 0

    def die() -> None:
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == occurrence and when == "before":
            die()
        result = original(*args, **kwargs)
        if calls == occurrence and when == "after":
            die()
        return result

    return wrapped


def main() -> int:
    point, when, rank, occurrence, marker, separator, *args = sys.argv[1:]
    assert separator == "--" and when in ("before", "after")
    if int(os.environ["RANK"]) == int(rank) and not Path(marker).exists():
        module, name = POINTS[point]
        setattr(module, name, armed(getattr(module, name), when, int(occurrence), Path(marker)))
    return cli.main(args)


if __name__ == "__main__":
    sys.exit(main())
