"""What the shared-cores tests run in fresh processes."""

from __future__ import annotations

import time
from typing import Any

from pipetrain.app.shared_cores import measure_shared_cores_factor

ALONE_S, TOGETHER_S, WARMUP, REPEATS = 0.01, 0.025, 1, 8


def factor_on_a_counted_clock() -> dict[str, Any]:
    """The factor read on a clock that each run of the work advances by ``ALONE_S`` in the
    rank's turn (its first ``WARMUP + REPEATS`` runs) and by ``TOGETHER_S`` after, so that
    the factor is known exactly; and when (on the wall clock) each phase's runs began."""
    starts: list[float] = []
    clock = [0.0]

    def work() -> None:
        starts.append(time.perf_counter())
        clock[0] += ALONE_S if len(starts) <= WARMUP + REPEATS else TOGETHER_S

    factor = measure_shared_cores_factor(
        work, 1, repeats=REPEATS, warmup=WARMUP, clock=lambda: clock[0]
    )
    alone = starts[: WARMUP + REPEATS]
    return {"factor": factor, "alone": (alone[0], alone[-1]), "together": starts[len(alone)]}
