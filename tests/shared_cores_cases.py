"""What the shared-cores tests run in fresh processes (they pin themselves to one core)."""

from __future__ import annotations

import os
import time

import torch

from pipetrain.app.shared_cores import measure_shared_cores_factor


def _work() -> None:
    """Some 25 ms of one core's work: longer than the scheduler's slice, so that together
    every run waits for the other rank's share of the core."""
    matrix = torch.rand(96, 96)
    for _ in range(1500):
        matrix = torch.mm(matrix, matrix).clamp_(0.0, 1.0)


def factors_on_one_core() -> tuple[float, float]:
    """Every rank on the same single core, taking turns of one: the factor read on the wall
    clock (which counts the wait for the core) and on the process's CPU time (which does
    not)."""
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    return (
        measure_shared_cores_factor(_work, 1, repeats=8, warmup=1, clock=time.perf_counter),
        measure_shared_cores_factor(_work, 1, repeats=8, warmup=1),
    )
