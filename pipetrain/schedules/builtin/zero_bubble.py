"""Zero-bubble ZB-H1: the backward split into B (input gradient) and W (weight gradient)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from functools import lru_cache

from pipetrain.schedules.actions import Action, Kind, shared_ints, trusted_action
from pipetrain.schedules.builtin.unit_time import peak_held
from pipetrain.schedules.registry import (
    Bubble,
    Generated,
    Options,
    ScheduleSpec,
    UniformCosts,
)


def generate(
    ranks: int, microbatches: int, replicas: Sequence[int] | None, options: Options
) -> Generated:
    """Each rank's passes as list scheduling under unit costs orders them (see
    :func:`_list_scheduled`), then its optimizer step."""
    written = [
        [*order, Action(Kind.STEP, rank)] for rank, order in enumerate(_orders(ranks, microbatches))
    ]
    return Generated(written, [(rank,) for rank in range(ranks)])


def _list_scheduled(ranks: int, microbatches: int) -> list[list[Action]]:
    """Each rank's passes, built by list scheduling under unit costs (F = B = W = 1).

    A rank runs a ready B first, then a forward while fewer than ``stages - s``
    micro-batches are in flight (the 1F1B memory limit), and a deferred W whenever it would
    otherwise wait or holds more than ``stages`` deferred W's. Deferring W's lets every B
    travel up the pipeline at once, so with F = B = W the bubble is (p − 1)/(3m + p − 1), a
    third of 1F1B's. A deferred W still needs its micro-batch's activations, so a rank
    holds more micro-batches than 1F1B's limit until its W's run (:func:`in_flight`).
    """
    p, m = ranks, microbatches
    numbers = shared_ints(m)
    forward_done = [[math.inf] * m for _ in range(p)]
    backward_done = [[math.inf] * m for _ in range(p)]
    next_forward, next_backward = [0] * p, [0] * p
    pending_weight: list[deque[int]] = [deque() for _ in range(p)]
    busy_until = [0] * p
    built: list[list[Action]] = [[] for _ in range(p)]
    finished = time = 0
    while finished < p:
        for rank in range(p):
            if busy_until[rank] > time or len(built[rank]) == 3 * m:
                continue
            limit = min(p - rank, m)
            f, b = next_forward[rank], next_backward[rank]
            b_ready = b < f and (rank == p - 1 or backward_done[rank + 1][b] <= time)
            f_ready = f < m and f - b < limit and (rank == 0 or forward_done[rank - 1][f] <= time)
            if b_ready:
                built[rank].append(Action(Kind.BACKWARD, rank, numbers[b]))
                backward_done[rank][b] = time + 1
                next_backward[rank] += 1
                pending_weight[rank].append(b)
            elif pending_weight[rank] and (len(pending_weight[rank]) > p or not f_ready):
                built[rank].append(
                    Action(Kind.WEIGHT, rank, numbers[pending_weight[rank].popleft()])
                )
            elif f_ready:
                built[rank].append(Action(Kind.FORWARD, rank, numbers[f]))
                forward_done[rank][f] = time + 1
                next_forward[rank] += 1
            else:
                continue
            busy_until[rank] = time + 1
            if len(built[rank]) == 3 * m:
                finished += 1
        time += 1
    return built


@lru_cache(maxsize=256)
def _orders(ranks: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """:func:`_list_scheduled`, kept: the planner's memory model, bound and build read it.
    Each lane's actions are made afresh, one lane after another, so a lane lies together in
    memory (list scheduling makes them a time step, across every rank, at a time) and the
    passes that walk it lane by lane stay in the caches."""
    return tuple(tuple(map(trusted_action, lane)) for lane in _list_scheduled(ranks, microbatches))


@lru_cache(maxsize=256)
def _peaks(ranks: int, microbatches: int) -> tuple[int, ...]:
    return tuple(peak_held(_orders(ranks, microbatches)))


def in_flight(stage: int, microbatches: int, replicas: Sequence[int], chunks: int) -> int:
    """Micro-batches rank ``stage`` holds at once, from each forward to its W (a deferred W
    keeps the activations its weight gradient reads), read from the order."""
    return _peaks(len(replicas), microbatches)[stage]


def bubble(ranks: int, microbatches: int, options: Options, costs: UniformCosts) -> Bubble | None:
    """The zero-bubble paper's count, where it holds (m >= p and W <= min(F, B))."""
    f, b, w = costs
    if microbatches < ranks or w > min(f, b):
        return None
    idle = (ranks - 1) * (f + b - w)
    return "(p-1)(F+B-W)/(m(F+B+W)+(p-1)(F+B-W))", idle / (microbatches * (f + b + w) + idle)


SPEC = ScheduleSpec(
    name="zb-h1",
    summary="zero-bubble ZB-H1: B and W apart, W's fill the bubble; one synchronous update",
    generate=generate,
    split_backward=True,
    in_flight=in_flight,
    textbook_bubble=bubble,
    default_costs={"forward_s": 1.0, "backward_s": 1.0, "weight_s": 1.0},
    planned_by_default=True,
)
