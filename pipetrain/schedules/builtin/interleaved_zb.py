"""Interleaved zero bubble: ``virtual`` chunks per rank placed as in ``interleaved``
(stage ``chunk·p + rank``), the backward split into B and W, and the W's deferred into the
gaps, holding no more chunk micro-batches than interleaved 1F1B; one synchronous update."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.builtin.interleaved import generate as interleaved_order
from pipetrain.schedules.builtin.interleaved import in_flight as interleaved_in_flight
from pipetrain.schedules.builtin.unit_time import (
    list_schedule,
    peak_held,
    shortest,
    with_deferred_weights,
)
from pipetrain.schedules.registry import Generated, Option, Options, ScheduleSpec


def caps(ranks: int, microbatches: int, virtual: int) -> list[int]:
    """Per rank, the chunk micro-batches interleaved 1F1B holds (Megatron-LM's warm-up depth
    plus one), here counted until each W."""
    replicas = [1] * ranks
    return [interleaved_in_flight(rank, microbatches, replicas, virtual) for rank in range(ranks)]


@lru_cache(maxsize=256)
def _orders(ranks: int, microbatches: int, virtual: int) -> tuple[tuple[Action, ...], ...]:
    placement = [stage % ranks for stage in range(ranks * virtual)]
    cap = caps(ranks, microbatches, virtual)
    candidates = [list_schedule(placement, microbatches, cap, reserve) for reserve in (True, False)]
    if not microbatches % ranks:  # Megatron-LM's interleaved order, its W's moved into gaps
        written = interleaved_order(ranks, microbatches, None, {"virtual": virtual}).orders
        passes = [[a for a in order if a.kind is not Kind.STEP] for order in written]
        candidates.append(with_deferred_weights(passes, ranks * virtual, cap))
    best = shortest(candidates, cap, ranks * virtual)
    # made afresh lane by lane: list scheduling makes them a time unit at a time across the
    # ranks, and every later pass reads a lane in order (close in memory: about 8% faster)
    return tuple(tuple(Action._make(action) for action in order) for order in best)


def generate(
    ranks: int, microbatches: int, replicas: Sequence[int] | None, options: Options
) -> Generated:
    """The shortest order at unit costs (F = B = W) within :func:`caps`, then the steps."""
    p, v = ranks, int(options["virtual"])
    orders = [list(order) for order in _orders(p, microbatches, v)]
    for rank, order in enumerate(orders):
        order += [Action(Kind.STEP, chunk * p + rank) for chunk in range(v)]
    return Generated(orders, [(stage % p,) for stage in range(p * v)])


@lru_cache(maxsize=256)
def _peaks(ranks: int, microbatches: int, virtual: int) -> tuple[int, ...]:
    return tuple(peak_held([list(o) for o in _orders(ranks, microbatches, virtual)]))


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
