"""GPipe: all forwards, then all backwards (fill and drain), one update per mini-batch."""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.builtin.common import (
    assign_ranks,
    fill_and_drain_bubble,
    flush,
    local_microbatches,
    stage_replicas,
)
from pipetrain.schedules.registry import Generated, Options, ScheduleSpec


def generate(
    ranks: int, microbatches: int, replicas: Sequence[int] | None, options: Options
) -> Generated:
    """Every rank runs its micro-batches' forwards, then their backwards, then steps."""
    stage_ranks = assign_ranks(stage_replicas(ranks, replicas))
    orders = []
    for stage, ranks_of_stage in enumerate(stage_ranks):
        for local in local_microbatches(len(ranks_of_stage), microbatches):
            order = [Action(Kind.FORWARD, stage, k) for k in local]
            order += [Action(Kind.BACKWARD, stage, k) for k in local]
            orders.append(order + flush(stage, len(ranks_of_stage) > 1))
    return Generated(orders, stage_ranks)


def _in_flight(stage: int, microbatches: int, replicas: Sequence[int], chunks: int) -> int:
    return -(-microbatches // replicas[stage])  # every local micro-batch


SPEC = ScheduleSpec(
    name="gpipe",
    summary="GPipe: all forwards, then all backwards; one synchronous update",
    generate=generate,
    replicable=True,
    in_flight=_in_flight,
    textbook_bubble=fill_and_drain_bubble,
    planned_by_default=True,
)
