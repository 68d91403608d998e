"""Workers for the gloo event-loop thread tests (importable by spawned workers)."""

from __future__ import annotations

import os
from contextlib import suppress

from graph_cases import lm_loss, tied_sequential
from pipeline_cases import mlp
from settings import make_pipeline
from torch import nn

from pipetrain.distributed.io_threads import LOOP_THREAD


def _policies() -> dict[str, list[int]]:
    """Scheduling policy of each of this process's threads, by thread name."""
    found: dict[str, list[int]] = {}
    for thread in os.listdir("/proc/self/task"):
        with suppress(OSError):
            with open(f"/proc/self/task/{thread}/comm") as name:
                comm = name.read().strip()
            found.setdefault(comm, []).append(os.sched_getscheduler(int(thread)))
    return found


def policies_after_launch() -> tuple[list[int], int]:
    """The policies of gloo's event-loop threads once the launcher made the group, and the
    policy of this (the calling) thread."""
    return _policies().get(LOOP_THREAD, []), os.sched_getscheduler(0)


def policies_after_replicated_pipeline() -> tuple[int, list[int]]:
    """How many gloo event-loop threads there were before a pipeline with a replicated stage
    made its replicas' group, and the policies of those there are after."""
    before = len(_policies().get(LOOP_THREAD, []))
    make_pipeline(
        mlp(),
        balance=[5],
        replicas=[2],
        microbatches=2,
        loss_fn=nn.functional.cross_entropy,
    )
    return before, _policies().get(LOOP_THREAD, [])


def policies_after_tied_pipeline() -> tuple[int, list[int]]:
    """As :func:`policies_after_replicated_pipeline`, for a pipeline whose first and last
    stages share a weight (its holders' group)."""
    before = len(_policies().get(LOOP_THREAD, []))
    make_pipeline(tied_sequential(), balance=[2, 3], microbatches=2, loss_fn=lm_loss)
    return before, _policies().get(LOOP_THREAD, [])
