"""What the V-shaped families share: two chunks per rank in a V, and their orders.

Rank ``r`` of ``p`` holds model stages ``r`` and ``2p − 1 − r``, so a micro-batch's forward
runs down the ranks and back up, its backward down and back up again, and the first and
last stages share rank 0 (Qi et al., "Pipeline Parallelism with Controllable Memory",
NeurIPS 2024). The families differ only in the chunk micro-batches a rank may hold
(:func:`v_orders`' ``slots``): ``2p`` for ``zb-v``, about half and a third of that for
``v-half`` and ``v-min``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from functools import lru_cache

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.builtin.unit_time import (
    PERIOD,
    Block,
    Orders,
    list_schedule,
    peak_held,
    repeated_block,
    shortest,
)
from pipetrain.schedules.registry import Generated, Option, Options, ScheduleSpec

CHUNKS = Option("virtual", 2, "model chunks per rank (a V holds 2)", minimum=2)
"""The chunk count of a V, as an option so that plans and the command line name it as they
do for ``interleaved``; :func:`check_v` refuses any other value."""


def v_placement(stage: int, ranks: int) -> int:
    """The rank holding ``stage`` in a V: ``r`` holds stages ``r`` and ``2·ranks − 1 − r``."""
    return stage if stage < ranks else 2 * ranks - 1 - stage


Check = Callable[[int, int, Sequence[int] | None, Options], None]
"""A spec's ``check(ranks, microbatches, replicas, options)``."""


def check_v(name: str) -> Check:
    """A spec's ``check`` for family ``name``: refuses a chunk count other than 2."""

    def check(
        ranks: int, microbatches: int, replicas: Sequence[int] | None, options: Options
    ) -> None:
        if options["virtual"] != 2:
            raise ValueError(f"{name} places 2 chunks per rank in a V; virtual must be 2")

    return check


def tight_block(ranks: int, delay: int) -> Block:
    """A V building block with every pass as early as its rank's free time units allow
    (each rank's six passes at distinct times modulo :data:`PERIOD`) and each W at the
    first free unit at least ``delay`` units after its B."""
    taken: list[set[int]] = [set() for _ in range(ranks)]
    block: Block = {}

    def place(kind: Kind, stage: int, time: int) -> int:
        rank = v_placement(stage, ranks)
        while time % PERIOD in taken[rank]:
            time += 1
        taken[rank].add(time % PERIOD)
        block[(kind, stage)] = time
        return time

    time = 0
    for stage in range(2 * ranks):
        time = place(Kind.FORWARD, stage, time) + 1
    for stage in reversed(range(2 * ranks)):
        time = place(Kind.BACKWARD, stage, time) + 1
        place(Kind.WEIGHT, stage, block[(Kind.BACKWARD, stage)] + 1 + delay)
    return block


def zb_v_order(ranks: int, microbatches: int) -> Orders:
    """The ZB-V paper's order (as ``torch.distributed.pipelining`` writes it), built for at
    least ``2p − 1`` micro-batches and the missing ones left out. Rank ``r``, whose chunks
    are ``c0 = r`` and ``c1 = 2p − 1 − r``: ``2(p − r) − 1`` forwards of ``c0``; ``r`` times
    F ``c1``, F ``c0``; ``p − r`` times F, B, W of ``c1``; then F ``c0`` (while any are left),
    B, W of ``c0``, F, B, W of ``c1`` until every forward ran; then ``r`` times B ``c0``,
    B ``c1``; ``p − r`` times B, W of ``c0``; and the ``r`` W's still owed on each chunk,
    ``c1``'s first."""
    p, total = ranks, max(2 * ranks - 1, microbatches)
    orders: Orders = []
    for rank in range(p):
        c0, c1 = rank, 2 * p - 1 - rank
        order: list[tuple[Kind, int]] = [(Kind.FORWARD, c0)] * (2 * (p - rank) - 1)
        order += [(Kind.FORWARD, c1), (Kind.FORWARD, c0)] * rank
        order += [(Kind.FORWARD, c1), (Kind.BACKWARD, c1), (Kind.WEIGHT, c1)] * (p - rank)
        forwards = {c0: 2 * (p - rank) - 1 + rank, c1: p}
        while forwards[c0] < total or forwards[c1] < forwards[c0]:
            if forwards[c0] < total:
                order.append((Kind.FORWARD, c0))
                forwards[c0] += 1
            order += [(Kind.BACKWARD, c0), (Kind.WEIGHT, c0)]
            order += [(Kind.FORWARD, c1), (Kind.BACKWARD, c1), (Kind.WEIGHT, c1)]
            forwards[c1] += 1
        order += [(Kind.BACKWARD, c0), (Kind.BACKWARD, c1)] * rank
        order += [(Kind.BACKWARD, c0), (Kind.WEIGHT, c0)] * (p - rank)
        order += [(Kind.WEIGHT, c1)] * rank + [(Kind.WEIGHT, c0)] * rank
        orders.append(_numbered(order, microbatches))
    return orders


def _numbered(order: list[tuple[Kind, int]], microbatches: int) -> list[Action]:
    """Each (kind, stage) pass given the next micro-batch of its kind and stage; those past
    ``microbatches`` left out."""
    count: dict[tuple[Kind, int], int] = {}
    numbered = []
    for kind, stage in order:
        k = count.get((kind, stage), 0)
        count[(kind, stage)] = k + 1
        if k < microbatches:
            numbered.append(Action(kind, stage, k))
    return numbered


@lru_cache(maxsize=256)
def _orders(ranks: int, microbatches: int, slots: int) -> tuple[tuple[Action, ...], ...]:
    placement = [v_placement(stage, ranks) for stage in range(2 * ranks)]
    cap = [slots] * ranks
    candidates = itertools.chain(
        [zb_v_order(ranks, microbatches)],
        (list_schedule(placement, microbatches, cap, reserve) for reserve in (True, False)),
        (
            repeated_block(placement, microbatches, tight_block(ranks, delay))
            for delay in range(PERIOD)
        ),
    )
    best = shortest(candidates, cap, 2 * ranks)
    # made afresh lane by lane: list scheduling makes them a time unit at a time across the
    # ranks, and every later pass reads a lane in order (close in memory: about 8% faster)
    return tuple(tuple(Action._make(action) for action in order) for order in best)


def v_orders(ranks: int, microbatches: int, slots: int) -> Orders:
    """The shortest order at unit costs, among list scheduling and repeated building blocks,
    that holds at most ``slots`` chunk micro-batches on any rank (``slots`` ≥ 2)."""
    return [list(order) for order in _orders(ranks, microbatches, slots)]


def generate_v(ranks: int, microbatches: int, slots: int) -> Generated:
    """:func:`v_orders` with each rank's two optimizer steps at the end."""
    orders = v_orders(ranks, microbatches, slots)
    for rank, order in enumerate(orders):
        order += [Action(Kind.STEP, rank), Action(Kind.STEP, 2 * ranks - 1 - rank)]
    return Generated(orders, [(v_placement(stage, ranks),) for stage in range(2 * ranks)])


@lru_cache(maxsize=256)
def _peaks(ranks: int, microbatches: int, slots: int) -> tuple[int, ...]:
    return tuple(peak_held(v_orders(ranks, microbatches, slots)))


def v_in_flight(slots: int, stage: int, microbatches: int, replicas: Sequence[int]) -> int:
    """Chunk micro-batches rank ``stage`` holds at once in :func:`v_orders`."""
    return _peaks(len(replicas), microbatches, slots)[stage]


def v_spec(name: str, summary: str, slots: Callable[[int], int]) -> ScheduleSpec:
    """A V family's spec: on p ranks, orders holding at most ``slots(p)`` chunk
    micro-batches per rank, split backward, F = B = W as default costs."""

    def generate(
        ranks: int, microbatches: int, replicas: Sequence[int] | None, options: Options
    ) -> Generated:
        return generate_v(ranks, microbatches, slots(ranks))

    def in_flight(stage: int, microbatches: int, replicas: Sequence[int], chunks: int) -> int:
        return v_in_flight(slots(len(replicas)), stage, microbatches, replicas)

    return ScheduleSpec(
        name=name,
        summary=summary,
        generate=generate,
        options=(CHUNKS,),
        check=check_v(name),
        chunk_option="virtual",
        placement=v_placement,
        split_backward=True,
        in_flight=in_flight,
        default_costs={"forward_s": 1.0, "backward_s": 1.0, "weight_s": 1.0},
        planned_by_default=True,
    )
