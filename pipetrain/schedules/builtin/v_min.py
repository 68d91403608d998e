"""V-Min: two chunks per rank in a V, B and W apart, with a third of 1F1B's activation memory.

A rank holds at most (p + 4) // 3 micro-batches' worth of activations; with F = B = W the
authors give a bubble of about 2p / 3m, two thirds of 1F1B's. A micro-batch's worth is its
activations on one rank's layers, two chunk micro-batches; the order is the shortest at
unit costs within that.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.schedules.builtin.vshape import (
    CHUNKS,
    check_v,
    generate_v,
    v_in_flight,
    v_placement,
)
from pipetrain.schedules.registry import Generated, Options, ScheduleSpec


def slots(ranks: int) -> int:
    """Chunk micro-batches a rank may hold."""
    return 2 * ((ranks + 4) // 3)


def generate(
    ranks: int, microbatches: int, replicas: Sequence[int] | None, options: Options
) -> Generated:
    """The V's shortest order at unit costs holding at most :func:`slots` per rank."""
    return generate_v(ranks, microbatches, slots(ranks))


def in_flight(stage: int, microbatches: int, replicas: Sequence[int], chunks: int) -> int:
    """Chunk micro-batches rank ``stage`` holds at once, read from the order."""
    return v_in_flight(slots(len(replicas)), stage, microbatches, replicas)


SPEC = ScheduleSpec(
    name="v-min",
    summary="V-Min: two chunks per rank in a V, B and W apart; a third of 1F1B's activation memory",
    generate=generate,
    options=(CHUNKS,),
    check=check_v("v-min"),
    chunk_option="virtual",
    placement=v_placement,
    split_backward=True,
    in_flight=in_flight,
    default_costs={"forward_s": 1.0, "backward_s": 1.0, "weight_s": 1.0},
    planned_by_default=True,
)
