"""Schedule generators: each returns every rank's compute order (no communication yet).

Each generator takes the number of ranks of the pipeline and the micro-batch count and
returns ``(compute_orders, stage_ranks)``; :func:`pipetrain.schedules.build` adds the
sends and receives and validates the result.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from pipetrain.schedules.actions import Action, Kind

Orders = list[list[Action]]
StageRanks = list[tuple[int, ...]]


def assign_ranks(replicas: Sequence[int]) -> StageRanks:
    """Give each stage consecutive ranks: replicas [2, 1] -> stage 0 on (0, 1), stage 1 on (2,)."""
    stage_ranks, next_rank = [], 0
    for count in replicas:
        stage_ranks.append(tuple(range(next_rank, next_rank + count)))
        next_rank += count
    return stage_ranks


def _local_microbatches(stage_ranks: StageRanks, stage: int, rank: int, total: int) -> list[int]:
    ranks = stage_ranks[stage]
    return [k for k in range(total) if ranks[k % len(ranks)] == rank]


def in_flight_limit(replicas: Sequence[int], stage: int) -> int:
    """Micro-batches a stage keeps in flight to fill the pipeline (PipeDream's NOAM per stage)."""
    return math.ceil(sum(replicas[stage:]) / replicas[stage])


def _flush(stage: int, replicated: bool) -> list[Action]:
    tail = [Action(Kind.ALLREDUCE, stage)] if replicated else []
    return tail + [Action(Kind.STEP, stage)]


def _one_f_one_b(stage: int, local: Sequence[int], limit: int) -> list[Action]:
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


def gpipe(
    ranks: int, microbatches: int, replicas: Sequence[int] | None = None
) -> tuple[Orders, StageRanks]:
    """GPipe: all forwards, then all backwards (fill and drain), one update per mini-batch."""
    replicas = list(replicas or [1] * ranks)
    stage_ranks = assign_ranks(replicas)
    orders: Orders = []
    for stage, ranks_of_stage in enumerate(stage_ranks):
        for rank in ranks_of_stage:
            local = _local_microbatches(stage_ranks, stage, rank, microbatches)
            order = [Action(Kind.FORWARD, stage, k) for k in local]
            order += [Action(Kind.BACKWARD, stage, k) for k in local]
            orders.append(order + _flush(stage, len(ranks_of_stage) > 1))
    return orders, stage_ranks


def one_f_one_b(
    ranks: int, microbatches: int, replicas: Sequence[int] | None = None
) -> tuple[Orders, StageRanks]:
    """1F1B with a flush (PipeDream-Flush): at most ``stages - s`` micro-batches in flight on stage s."""
    replicas = list(replicas or [1] * ranks)
    stage_ranks = assign_ranks(replicas)
    orders: Orders = []
    for stage, ranks_of_stage in enumerate(stage_ranks):
        limit = in_flight_limit(replicas, stage)
        for rank in ranks_of_stage:
            local = _local_microbatches(stage_ranks, stage, rank, microbatches)
            orders.append(
                _one_f_one_b(stage, local, limit) + _flush(stage, len(ranks_of_stage) > 1)
            )
    return orders, stage_ranks


def interleaved(ranks: int, microbatches: int, virtual: int = 2) -> tuple[Orders, StageRanks]:
    """Megatron-LM's interleaved 1F1B: ``virtual`` model chunks per rank, stage = chunk·ranks + rank."""
    p, v, m = ranks, virtual, microbatches
    total = m * v

    def unit(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        if not forward:
            chunk = v - 1 - chunk
        return chunk, (k // (p * v)) * p + k % p

    stage_ranks = [(stage % p,) for stage in range(p * v)]
    orders: Orders = []
    for rank in range(p):
        warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
        order: list[Action] = []

        def forward(k: int) -> None:
            chunk, mb = unit(k, True)
            order.append(Action(Kind.FORWARD, chunk * p + rank, mb))

        def backward(k: int) -> None:
            chunk, mb = unit(k, False)
            order.append(Action(Kind.BACKWARD, chunk * p + rank, mb))

        for k in range(warmup):
            forward(k)
        for i in range(total - warmup):
            forward(warmup + i)
            backward(i)
        for i in range(total - warmup, total):
            backward(i)
        for chunk in range(v):
            order.append(Action(Kind.STEP, chunk * p + rank))
        orders.append(order)
    return orders, stage_ranks


def zero_bubble_h1(ranks: int, microbatches: int) -> tuple[Orders, StageRanks]:
    """ZB-H1: backward split into B (input gradient) and W (weight gradient).

    Built by list scheduling under unit costs (F = B = W = 1): a rank runs a ready B
    first, then a forward while fewer than ``stages - s`` micro-batches are in flight (the
    1F1B memory limit), and a deferred W whenever it would otherwise wait or holds more than
    ``stages`` deferred W's. Deferring W's lets every B travel up the pipeline at once, so
    with F = B = W the bubble is (p − 1)/(3m + p − 1), a third of 1F1B's.
    """
    p, m = ranks, microbatches
    forward_done = [[math.inf] * m for _ in range(p)]
    backward_done = [[math.inf] * m for _ in range(p)]
    next_forward, next_backward = [0] * p, [0] * p
    pending_weight: list[deque[int]] = [deque() for _ in range(p)]
    busy_until = [0] * p
    orders: Orders = [[] for _ in range(p)]
    finished = 0
    time = 0
    while finished < p:
        for rank in range(p):
            if busy_until[rank] > time or len(orders[rank]) == 3 * m:
                continue
            limit = min(p - rank, m)
            f, b = next_forward[rank], next_backward[rank]
            b_ready = b < f and (rank == p - 1 or backward_done[rank + 1][b] <= time)
            f_ready = f < m and f - b < limit and (rank == 0 or forward_done[rank - 1][f] <= time)
            if b_ready:
                orders[rank].append(Action(Kind.BACKWARD, rank, b))
                backward_done[rank][b] = time + 1
                next_backward[rank] += 1
                pending_weight[rank].append(b)
            elif pending_weight[rank] and (len(pending_weight[rank]) > p or not f_ready):
                orders[rank].append(Action(Kind.WEIGHT, rank, pending_weight[rank].popleft()))
            elif f_ready:
                orders[rank].append(Action(Kind.FORWARD, rank, f))
                forward_done[rank][f] = time + 1
                next_forward[rank] += 1
            else:
                continue
            busy_until[rank] = time + 1
            if len(orders[rank]) == 3 * m:
                finished += 1
        time += 1
    for rank in range(p):
        orders[rank].append(Action(Kind.STEP, rank))
    return orders, [(rank,) for rank in range(p)]


def pipedream(
    ranks: int,
    microbatches: int,
    vertical_sync: bool = False,
    replicas: Sequence[int] | None = None,
) -> tuple[Orders, StageRanks]:
    """PipeDream's asynchronous 1F1B: no flush, an update after every backward, weight stashing.

    ``microbatches`` is the number of mini-batches in the window. Each forward uses the
    newest weights on its stage and records that version; its backward uses the same one.
    With ``vertical_sync`` every stage uses the version the input stage used. A replicated
    stage takes mini-batches round-robin; after each backward its replicas all-reduce
    their gradients and update together, once per ``replicas`` mini-batches.
    """
    replicas = list(replicas or [1] * ranks)
    stage_ranks = assign_ranks(replicas)
    orders: Orders = []
    for stage, ranks_of_stage in enumerate(stage_ranks):
        limit = in_flight_limit(replicas, stage)
        for rank in ranks_of_stage:
            order = []
            for action in _one_f_one_b(
                stage, _local_microbatches(stage_ranks, stage, rank, microbatches), limit
            ):
                order.append(action)
                if action.kind is Kind.BACKWARD:
                    order += _flush(stage, len(ranks_of_stage) > 1)
            orders.append(order)
    return _stamp_versions(orders, lambda stage, mb, steps: steps, vertical_sync), stage_ranks


def two_bw(ranks: int, microbatches: int, rounds: int = 2) -> tuple[Orders, StageRanks]:
    """PipeDream-2BW: 1F1B without flushes; an update every ``microbatches`` backwards.

    Mini-batch t (``microbatches`` micro-batches) runs on weight version t − 1 (version 0
    for t = 0), so W(t+1) = W(t) − ν·∇f(W(t−1)) and each stage holds two versions.
    """
    replicas = [1] * ranks
    stage_ranks = assign_ranks(replicas)
    total = microbatches * rounds
    orders: Orders = []
    for stage in range(ranks):
        order = []
        for action in _one_f_one_b(stage, range(total), in_flight_limit(replicas, stage)):
            order.append(action)
            if action.kind is Kind.BACKWARD and (action.microbatch + 1) % microbatches == 0:
                order.append(Action(Kind.STEP, stage))
        orders.append(order)
    return _stamp_versions(
        orders, lambda stage, mb, steps: max(mb // microbatches - 1, 0), False
    ), stage_ranks


def _stamp_versions(orders: Orders, version_rule, vertical_sync: bool) -> Orders:
    """Attach weight versions: ``version_rule(stage, mb, steps so far)`` for each forward, the
    same version for its backward, and the produced version for each STEP."""
    forward_version: dict[tuple[int, int], int] = {}
    stamped_orders: Orders = []
    for order in orders:
        steps = 0
        stamped: list[Action] = []
        for action in order:
            if action.kind is Kind.FORWARD:
                version = version_rule(action.stage, action.microbatch, steps)
                forward_version[(action.stage, action.microbatch)] = version
            elif action.kind is Kind.STEP:
                steps += 1
                version = steps
            elif action.kind is Kind.ALLREDUCE:
                version = None
            else:
                version = forward_version[(action.stage, action.microbatch)]
            stamped.append(Action(action.kind, action.stage, action.microbatch, version=version))
        stamped_orders.append(stamped)
    if not vertical_sync:
        return stamped_orders
    # every stage uses, for mini-batch k, the version stage 0 used for k
    input_version = {mb: v for (stage, mb), v in forward_version.items() if stage == 0}
    return [
        [
            a
            if a.microbatch is None
            else Action(a.kind, a.stage, a.microbatch, version=input_version[a.microbatch])
            for a in order
        ]
        for order in stamped_orders
    ]
