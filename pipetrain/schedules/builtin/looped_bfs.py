"""Looped BFS (Lamy-Poirier, arXiv 2211.05953): ``virtual`` chunks per rank placed as in
``interleaved`` (stage ``chunk·p + rank``), each chunk running every micro-batch's forward
before the next chunk starts, and the backwards in reverse chunk order; one synchronous
update."""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.schedules.actions import Action, Kind, shared_ints
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
    """Rank ``r`` forwards every micro-batch through stage ``r``, then ``r + p``, …, then
    backwards them from its last stage to its first, then steps each stage."""
    p, v = ranks, int(options["virtual"])
    numbers = shared_ints(microbatches)
    orders = []
    for rank in range(p):
        stages = [chunk * p + rank for chunk in range(v)]
        order = [Action(Kind.FORWARD, s, k) for s in stages for k in numbers]
        order += [Action(Kind.BACKWARD, s, k) for s in reversed(stages) for k in numbers]
        order += [Action(Kind.STEP, s) for s in stages]
        orders.append(order)
    return Generated(orders, [(stage % p,) for stage in range(p * v)])


def in_flight(stage: int, microbatches: int, replicas: Sequence[int], chunks: int) -> int:
    """Every chunk micro-batch: all forwards come before the first backward."""
    return chunks * microbatches


def bubble(ranks: int, microbatches: int, options: Options, costs: UniformCosts) -> Bubble | None:
    """With m ≥ p a rank waits only for the first chunk to fill and the last to drain:
    (p − 1) / (v·m + p − 1), as interleaved 1F1B."""
    if microbatches < ranks:
        return None
    v = int(options["virtual"])
    return "(p-1)/(v*m+p-1)", (ranks - 1) / (v * microbatches + ranks - 1)


SPEC = ScheduleSpec(
    name="looped-bfs",
    summary="looped BFS: several chunks per rank, each chunk's forwards all at once; one update",
    generate=generate,
    options=(Option("virtual", 2, "model chunks per rank", minimum=2),),
    chunk_option="virtual",
    in_flight=in_flight,
    textbook_bubble=bubble,
    planned_by_default=True,
)
