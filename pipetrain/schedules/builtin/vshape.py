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

from pipetrain.allocation import collector_paused
from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.builtin.unit_search import coded_peaks, shortest
from pipetrain.schedules.builtin.unit_time import (
    PERIOD,
    Block,
    Coded,
    Coder,
    Found,
    Trial,
    list_schedules,
    repeated_block,
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


@lru_cache(maxsize=64)
def tight_block(ranks: int, delay: int) -> Block:
    """A V building block with every pass as early as its rank's free time units allow
    (each rank's six passes at distinct times modulo :data:`PERIOD`) and each W at the
    first free unit at least ``delay`` units after its B (kept: every micro-batch count's
    search repeats the same blocks)."""
    taken: list[set[int]] = [set() for _ in range(ranks)]
    block: dict[tuple[Kind, int], int] = {}

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


def zb_v_order(ranks: int, microbatches: int) -> Trial:
    """The ZB-V paper's order (as ``torch.distributed.pipelining`` writes it), built for at
    least ``2p − 1`` micro-batches and the missing ones left out. Rank ``r``, whose chunks
    are ``c0 = r`` and ``c1 = 2p − 1 − r``: ``2(p − r) − 1`` forwards of ``c0``; ``r`` times
    F ``c1``, F ``c0``; ``p − r`` times F, B, W of ``c1``; then F ``c0`` (while any are left),
    B, W of ``c0``, F, B, W of ``c1`` until every forward ran; then ``r`` times B ``c0``,
    B ``c1``; ``p − r`` times B, W of ``c0``; and the ``r`` W's still owed on each chunk,
    ``c1``'s first."""
    p, m, total = ranks, microbatches, max(2 * ranks - 1, microbatches)
    coder = Coder(2 * ranks, microbatches)
    orders: Coded = []
    for rank in range(p):
        # each pass as its micro-batch 0's code: the numbering below adds the micro-batch
        f0, b0, w0, f1, b1, w1 = (
            coder.code(kind, chunk, 0)
            for chunk in (rank, 2 * p - 1 - rank)
            for kind in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT)
        )
        order = [f0] * (2 * (p - rank) - 1) + [f1, f0] * rank + [f1, b1, w1] * (p - rank)
        forwards = [2 * (p - rank) - 1 + rank, p]  # of c0, of c1
        while forwards[0] < total or forwards[1] < forwards[0]:
            if forwards[0] < total:
                order.append(f0)
                forwards[0] += 1
            order += [b0, w0, f1, b1, w1]
            forwards[1] += 1
        order += [b0, b1] * rank + [b0, w0] * (p - rank) + [w1] * rank + [w0] * rank
        # the next micro-batch of each pass, -1 once past the last
        numbering = {
            pass_: itertools.chain(range(pass_, pass_ + m), itertools.repeat(-1)).__next__
            for pass_ in (f0, b0, w0, f1, b1, w1)
        }
        orders.append([code for code in [numbering[pass_]() for pass_ in order] if code >= 0])
    return Trial(orders)


def v_orders(ranks: int, microbatches: int, slots: int, exhaustive: bool = False) -> Found:
    """The shortest order at unit costs, among list scheduling and repeated building blocks,
    that holds at most ``slots`` chunk micro-batches on any rank (``slots`` ≥ 2), as
    :class:`~pipetrain.schedules.builtin.unit_time.Coder` codes; ``exhaustive`` times every
    candidate in full (see :func:`~pipetrain.schedules.builtin.unit_search.shortest`)."""
    # a rank holds at most 2m chunk micro-batches, so every cap above that finds one order
    return _orders(ranks, microbatches, min(slots, 2 * microbatches), exhaustive)


@lru_cache(maxsize=256)
def _orders(ranks: int, microbatches: int, slots: int, exhaustive: bool) -> Found:
    placement = [v_placement(stage, ranks) for stage in range(2 * ranks)]
    cap = [slots] * ranks
    candidates = itertools.chain(
        [zb_v_order(ranks, microbatches)],
        list_schedules(placement, microbatches, cap, both=exhaustive),
        (
            repeated_block(placement, microbatches, tight_block(ranks, delay))
            for delay in range(PERIOD)
        ),
    )
    with collector_paused():  # the candidates are many small objects, none of them cyclic
        found = shortest(candidates, cap, Coder(2 * ranks, microbatches), exhaustive)
        return tuple(map(tuple, found))


@lru_cache(maxsize=64)
def _written(ranks: int, microbatches: int, slots: int) -> tuple[tuple[Action, ...], ...]:
    """:func:`v_orders` as actions (kept: the planner bounds a candidate, then builds it)."""
    with collector_paused():
        orders = Coder(2 * ranks, microbatches).decode(v_orders(ranks, microbatches, slots))
        return tuple(map(tuple, orders))


def generate_v(ranks: int, microbatches: int, slots: int) -> Generated:
    """:func:`v_orders` with each rank's two optimizer steps at the end."""
    orders = [list(order) for order in _written(ranks, microbatches, min(slots, 2 * microbatches))]
    for rank, order in enumerate(orders):
        order += [Action(Kind.STEP, rank), Action(Kind.STEP, 2 * ranks - 1 - rank)]
    return Generated(orders, [(v_placement(stage, ranks),) for stage in range(2 * ranks)])


@lru_cache(maxsize=256)
def _peaks(ranks: int, microbatches: int, slots: int) -> tuple[int, ...]:
    coder = Coder(2 * ranks, microbatches)
    return tuple(coded_peaks(v_orders(ranks, microbatches, slots), coder))


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
