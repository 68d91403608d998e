"""PipeDream's asynchronous 1F1B: no flush, an update after every backward, weight stashing."""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.builtin.common import (
    assign_ranks,
    flush,
    in_flight_limit,
    local_microbatches,
    one_f_one_b,
    one_f_one_b_in_flight,
    stage_replicas,
    stamp_versions,
)
from pipetrain.schedules.registry import Generated, Option, Options, ScheduleSpec


def generate(
    ranks: int, microbatches: int, replicas: Sequence[int] | None, options: Options
) -> Generated:
    """``microbatches`` is the number of mini-batches in the window.

    Each forward uses the newest weights on its stage and records that version; its
    backward uses the same one. With ``vertical_sync`` every stage uses the version the
    input stage used. A replicated stage takes mini-batches round-robin; after each
    backward its replicas all-reduce their gradients and update together, once per
    ``replicas`` mini-batches.
    """
    counts = stage_replicas(ranks, replicas)
    stage_ranks = assign_ranks(counts)
    orders = []
    for stage, ranks_of_stage in enumerate(stage_ranks):
        limit = in_flight_limit(counts, stage)
        for local in local_microbatches(len(ranks_of_stage), microbatches):
            order: list[Action] = []
            for action in one_f_one_b(stage, local, limit):
                order.append(action)
                if action.kind is Kind.BACKWARD:
                    order += flush(stage, len(ranks_of_stage) > 1)
            orders.append(order)
    vertical_sync = bool(options["vertical_sync"])
    stamped = stamp_versions(orders, lambda stage, mb, steps: steps, vertical_sync)
    return Generated(stamped, stage_ranks, {"max_versions": len(orders) + 1})


def check(ranks: int, microbatches: int, replicas: Sequence[int] | None, options: Options) -> None:
    """Replicas update together, so mini-batches come in multiples of every replica count;
    vertical sync needs one update per mini-batch on every stage, which replicas break."""
    if replicas is None:
        return
    if options["vertical_sync"] and max(replicas) > 1:
        raise ValueError(
            "vertical_sync needs every stage to update once per mini-batch, which replicated "
            f"stages (replicas {list(replicas)}) do not; use one or the other"
        )
    if any(microbatches % r for r in replicas):
        raise ValueError(
            f"pipedream with replicas {list(replicas)} needs mini-batches in multiples of every "
            f"replica count, so replicas update together; got microbatches={microbatches}"
        )


SPEC = ScheduleSpec(
    name="pipedream",
    summary="PipeDream: asynchronous 1F1B, an update per mini-batch, weight stashing",
    generate=generate,
    options=(Option("vertical_sync", False, "every stage uses the input stage's version"),),
    check=check,
    asynchronous=True,
    replicable=True,
    per_update=lambda microbatches, options: 1,
    in_flight=one_f_one_b_in_flight,
    # one stashed version per in-flight mini-batch
    weight_versions=lambda stage, replicas, options: in_flight_limit(replicas, stage),
)
