"""PipeDream-2BW: 1F1B without flushes; an update every ``microbatches`` backwards."""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.builtin.common import (
    in_flight_limit,
    one_f_one_b,
    one_f_one_b_in_flight,
    stamp_versions,
)
from pipetrain.schedules.registry import (
    Bubble,
    Generated,
    Option,
    Options,
    ScheduleSpec,
    UniformCosts,
)


def generate(
    ranks: int, microbatches: int, replicas: Sequence[int] | None, options: Options
) -> Generated:
    """Mini-batch t (``microbatches`` micro-batches) runs on weight version t − 1 (version 0
    for t = 0), so W(t+1) = W(t) − ν·∇f(W(t−1)) and each stage holds two versions."""
    counts = [1] * ranks
    total = microbatches * int(options["rounds"])
    orders = []
    for stage in range(ranks):
        order: list[Action] = []
        for action in one_f_one_b(stage, range(total), in_flight_limit(counts, stage)):
            order.append(action)
            mb = action.microbatch
            if action.kind is Kind.BACKWARD and mb is not None and (mb + 1) % microbatches == 0:
                order.append(Action(Kind.STEP, stage))
        orders.append(order)
    stamped = stamp_versions(
        orders, lambda stage, mb, steps: max(mb // microbatches - 1, 0), vertical_sync=False
    )
    return Generated(stamped, [(stage,) for stage in range(ranks)], {"max_versions": 2})


def check(ranks: int, microbatches: int, replicas: Sequence[int] | None, options: Options) -> None:
    """An update's micro-batches must fill the pipeline."""
    if microbatches < ranks:
        raise ValueError(
            f"2bw needs microbatches >= ranks ({ranks}) per update, got {microbatches}"
        )


def bubble(ranks: int, microbatches: int, options: Options, costs: UniformCosts) -> Bubble:
    """One fill and drain for the whole window of ``rounds`` updates."""
    return "(p-1)/(r*m+p-1)", (ranks - 1) / (microbatches + ranks - 1)


SPEC = ScheduleSpec(
    name="2bw",
    summary="PipeDream-2BW: 1F1B without flushes, each update on one-update-old weights",
    generate=generate,
    options=(Option("rounds", 2, "updates in one call's window"),),
    check=check,
    asynchronous=True,
    window=lambda microbatches, options: microbatches * int(options["rounds"]),
    per_update=lambda microbatches, options: microbatches,
    in_flight=one_f_one_b_in_flight,
    weight_versions=lambda stage, replicas, options: 2,
    textbook_bubble=bubble,
)
