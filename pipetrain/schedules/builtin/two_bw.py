"""PipeDream-2BW: 1F1B without flushes; an update every ``microbatches`` backwards."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from pipetrain.allocation import collector_paused
from pipetrain.schedules.actions import Action, Kind, shared_ints, trusted_action
from pipetrain.schedules.builtin.common import one_f_one_b_in_flight
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
    orders = [list(order) for order in _orders(ranks, microbatches, int(options["rounds"]))]
    return Generated(orders, [(stage,) for stage in range(ranks)], {"max_versions": 2})


@lru_cache(maxsize=64)
def _orders(ranks: int, microbatches: int, rounds: int) -> tuple[tuple[Action, ...], ...]:
    """Every stage's :func:`_order` (kept: a window holds many actions, and the planner
    bounds a candidate, then builds it)."""
    total = microbatches * rounds
    with collector_paused():
        return tuple(
            tuple(_order(stage, ranks - stage, total, microbatches)) for stage in range(ranks)
        )


def _order(stage: int, limit: int, total: int, microbatches: int) -> list[Action]:
    """Stage ``stage``'s 1F1B order over ``total`` micro-batches with ``limit`` in flight
    (``common.one_f_one_b``), each F and B stamped with its version and a STEP after every
    ``microbatches`` backwards. Made in one pass: 2bw's windows hold twice a flushing
    family's actions, and a second pass to stamp versions was a fifth of a build."""
    forward, backward, step = Kind.FORWARD, Kind.BACKWARD, Kind.STEP
    warm_up = min(limit, total)
    numbers = shared_ints(total)
    order = [
        trusted_action((forward, stage, mb, None, max(mb // microbatches - 1, 0)))
        for mb in numbers[:warm_up]
    ]
    steps = 0
    for mb in numbers:
        order.append(trusted_action((backward, stage, mb, None, max(mb // microbatches - 1, 0))))
        if (mb + 1) % microbatches == 0:
            steps += 1
            order.append(trusted_action((step, stage, None, None, steps)))
        following = mb + warm_up
        if following < total:
            version = max(following // microbatches - 1, 0)
            order.append(trusted_action((forward, stage, numbers[following], None, version)))
    return order


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
