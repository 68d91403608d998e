"""Pieces the built-in families share: placement, 1F1B ordering, flushes, weight versions."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

from pipetrain.schedules.actions import Action, Kind, shared_ints
from pipetrain.schedules.registry import Bubble, Options, UniformCosts

Orders = list[list[Action]]
StageRanks = list[tuple[int, ...]]


def stage_replicas(ranks: int, replicas: Sequence[int] | None) -> list[int]:
    """Ranks per stage: ``replicas``, or one rank for each of ``ranks`` stages."""
    return list(replicas) if replicas is not None else [1] * ranks


def assign_ranks(replicas: Sequence[int]) -> StageRanks:
    """Give each stage consecutive ranks: replicas [2, 1] -> stage 0 on (0, 1), stage 1 on (2,)."""
    stage_ranks, next_rank = [], 0
    for count in replicas:
        stage_ranks.append(tuple(range(next_rank, next_rank + count)))
        next_rank += count
    return stage_ranks


def local_microbatches(position: int, replicas: int, total: int) -> tuple[int, ...]:
    """The micro-batches of ``total`` that round-robin routing gives the replica at
    ``position`` among a stage's ``replicas`` (as :func:`shared_ints`' objects)."""
    return shared_ints(total)[position::replicas]


def in_flight_limit(replicas: Sequence[int], stage: int) -> int:
    """Micro-batches a stage keeps in flight to fill the pipeline (PipeDream's NOAM per stage)."""
    return math.ceil(sum(replicas[stage:]) / replicas[stage])


def one_f_one_b_in_flight(
    stage: int, microbatches: int, replicas: Sequence[int], chunks: int
) -> int:
    """The 1F1B memory model: at most the in-flight limit, at most the rank's micro-batches."""
    return min(math.ceil(microbatches / replicas[stage]), in_flight_limit(replicas, stage))


def flush(stage: int, replicated: bool) -> list[Action]:
    """The end of an update: a replicated stage's all-reduce, then the optimizer step."""
    tail = [Action(Kind.ALLREDUCE, stage)] if replicated else []
    return [*tail, Action(Kind.STEP, stage)]


def one_f_one_b(stage: int, local: Sequence[int], limit: int) -> list[Action]:
    """Warm-up forwards up to ``limit`` in flight, then alternate backward and forward."""
    order: list[Action] = []
    forwards = deque(local)
    backwards = deque(local)
    while forwards and len(local) - len(forwards) < limit:
        order.append(Action(Kind.FORWARD, stage, forwards.popleft()))
    while backwards:
        order.append(Action(Kind.BACKWARD, stage, backwards.popleft()))
        if forwards:
            order.append(Action(Kind.FORWARD, stage, forwards.popleft()))
    return order


def fill_and_drain_bubble(
    ranks: int, microbatches: int, options: Options, costs: UniformCosts
) -> Bubble:
    """The fill-and-drain bubble at uniform costs: (p − 1) / (m + p − 1)."""
    return "(p-1)/(m+p-1)", (ranks - 1) / (microbatches + ranks - 1)


VersionRule = Callable[[int, int, int], int]
"""``rule(stage, micro-batch, updates so far on the rank)``: the version a forward uses."""


def stamp_versions(orders: Orders, rule: VersionRule, vertical_sync: bool) -> Orders:
    """Attach weight versions: ``rule`` for each forward, the same version for its backward,
    and the produced version for each STEP; with ``vertical_sync`` every stage uses, for
    mini-batch k, the version stage 0 used."""
    forward_version: dict[tuple[int, int], int] = {}
    stamped_orders: Orders = []
    for order in orders:
        steps = 0
        stamped: list[Action] = []
        for action in order:
            version: int | None
            mb = action.microbatch
            if action.kind is Kind.FORWARD and mb is not None:
                version = rule(action.stage, mb, steps)
                forward_version[(action.stage, mb)] = version
            elif action.kind is Kind.STEP:
                steps += 1
                version = steps
            elif action.kind is Kind.ALLREDUCE or mb is None:
                version = None
            else:
                version = forward_version[(action.stage, mb)]
            stamped.append(Action(action.kind, action.stage, mb, action.peer, version))
        stamped_orders.append(stamped)
    if not vertical_sync:
        return stamped_orders
    first = {mb: v for (stage, mb), v in forward_version.items() if stage == 0}
    return [
        [
            a
            if a.microbatch is None
            else Action(a.kind, a.stage, a.microbatch, a.peer, first[a.microbatch])
            for a in order
        ]
        for order in stamped_orders
    ]
