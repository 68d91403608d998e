"""Interleaved zero bubble: ``virtual`` chunks per rank placed as in ``interleaved``
(stage ``chunk·p + rank``), the backward split into B and W, and the W's deferred into the
gaps, holding no more chunk micro-batches than interleaved 1F1B; one synchronous update."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from pipetrain.allocation import collector_paused
from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.builtin.interleaved import generate as interleaved_order
from pipetrain.schedules.builtin.interleaved import in_flight as interleaved_in_flight
from pipetrain.schedules.builtin.unit_search import coded_peaks, shortest
from pipetrain.schedules.builtin.unit_time import (
    Coder,
    Found,
    Trial,
    list_schedules,
    with_deferred_weights,
)
from pipetrain.schedules.registry import Generated, Option, Options, ScheduleSpec


def caps(ranks: int, microbatches: int, virtual: int) -> list[int]:
    """Per rank, the chunk micro-batches interleaved 1F1B holds (Megatron-LM's warm-up depth
    plus one), here counted until each W."""
    replicas = [1] * ranks
    return [interleaved_in_flight(rank, microbatches, replicas, virtual) for rank in range(ranks)]


def orders(ranks: int, microbatches: int, virtual: int, exhaustive: bool = False) -> Found:
    """The shortest order at unit costs (F = B = W) within :func:`caps`, as
    :class:`~pipetrain.schedules.builtin.unit_time.Coder` codes; ``exhaustive`` times every
    candidate in full (see :func:`~pipetrain.schedules.builtin.unit_search.shortest`)."""
    return _orders(ranks, microbatches, virtual, exhaustive)


@lru_cache(maxsize=256)
def _orders(ranks: int, microbatches: int, virtual: int, exhaustive: bool) -> Found:
    stages = ranks * virtual
    placement = [stage % ranks for stage in range(stages)]
    cap = caps(ranks, microbatches, virtual)
    with collector_paused():  # the candidates are many small objects, none of them cyclic
        candidates: list[Trial | None] = [
            *list_schedules(placement, microbatches, cap, both=exhaustive)
        ]
        if not microbatches % ranks:  # Megatron-LM's interleaved order, its W's moved into gaps
            written = interleaved_order(ranks, microbatches, None, {"virtual": virtual}).orders
            passes = [[a for a in order if a.kind is not Kind.STEP] for order in written]
            candidates.append(with_deferred_weights(passes, stages, microbatches, cap))
        found = shortest(candidates, cap, Coder(stages, microbatches), exhaustive)
        return tuple(map(tuple, found))


@lru_cache(maxsize=64)
def _written(ranks: int, microbatches: int, virtual: int) -> tuple[tuple[Action, ...], ...]:
    """:func:`orders` as actions (kept: the planner bounds a candidate, then builds it)."""
    with collector_paused():
        decoded = Coder(ranks * virtual, microbatches).decode(orders(ranks, microbatches, virtual))
        return tuple(map(tuple, decoded))


def generate(
    ranks: int, microbatches: int, replicas: Sequence[int] | None, options: Options
) -> Generated:
    """The shortest order at unit costs (F = B = W) within :func:`caps`, then the steps."""
    p, v = ranks, int(options["virtual"])
    written = [list(order) for order in _written(p, microbatches, v)]
    for rank, order in enumerate(written):
        order += [Action(Kind.STEP, chunk * p + rank) for chunk in range(v)]
    return Generated(written, [(stage % p,) for stage in range(p * v)])


@lru_cache(maxsize=256)
def _peaks(ranks: int, microbatches: int, virtual: int) -> tuple[int, ...]:
    coder = Coder(ranks * virtual, microbatches)
    return tuple(coded_peaks(orders(ranks, microbatches, virtual), coder))


def in_flight(stage: int, microbatches: int, replicas: Sequence[int], chunks: int) -> int:
    """Chunk micro-batches rank ``stage`` holds at once, read from the order."""
    return _peaks(len(replicas), microbatches, chunks)[stage]


SPEC = ScheduleSpec(
    name="interleaved-zb",
    summary="interleaved zero bubble: chunks per rank, B and W apart; one synchronous update",
    generate=generate,
    options=(Option("virtual", 2, "model chunks per rank", minimum=2),),
    chunk_option="virtual",
    split_backward=True,
    in_flight=in_flight,
    default_costs={"forward_s": 1.0, "backward_s": 1.0, "weight_s": 1.0},
    planned_by_default=True,
)
