"""1F1B with a flush (PipeDream-Flush): at most ``stages - s`` micro-batches in flight on
stage ``s``, one synchronous update per mini-batch."""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.schedules.builtin.common import (
    assign_ranks,
    fill_and_drain_bubble,
    flush,
    in_flight_limit,
    local_microbatches,
    one_f_one_b,
    one_f_one_b_in_flight,
    stage_replicas,
)
from pipetrain.schedules.registry import Generated, Options, ScheduleSpec


def generate(
    ranks: int, microbatches: int, replicas: Sequence[int] | None, options: Options
) -> Generated:
    """Warm-up forwards, then one backward and one forward in turn, then the flush."""
    counts = stage_replicas(ranks, replicas)
    stage_ranks = assign_ranks(counts)
    orders = []
    for stage, ranks_of_stage in enumerate(stage_ranks):
        limit = in_flight_limit(counts, stage)
        for local in local_microbatches(len(ranks_of_stage), microbatches):
            orders.append(one_f_one_b(stage, local, limit) + flush(stage, len(ranks_of_stage) > 1))
    return Generated(orders, stage_ranks)


SPEC = ScheduleSpec(
    name="1f1b",
    summary="1F1B (PipeDream-Flush): one forward, one backward; one synchronous update",
    generate=generate,
    replicable=True,
    in_flight=one_f_one_b_in_flight,
    textbook_bubble=fill_and_drain_bubble,
    planned_by_default=True,
)
