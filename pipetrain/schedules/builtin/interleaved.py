"""Megatron-LM's interleaved 1F1B: ``virtual`` model chunks per rank, stage = chunk·ranks + rank."""

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
    """Megatron-LM's order: warm-up forwards over the chunks, then 1F1B, then the drain."""
    p, v = ranks, int(options["virtual"])
    total = microbatches * v
    numbers = shared_ints(microbatches)

    def unit(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        if not forward:
            chunk = v - 1 - chunk
        return chunk, numbers[(k // (p * v)) * p + k % p]

    orders = []
    for rank in range(p):
        warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
        order: list[Action] = []

        def run(k: int, kind: Kind, order: list[Action] = order, rank: int = rank) -> None:
            chunk, mb = unit(k, kind is Kind.FORWARD)
            order.append(Action(kind, chunk * p + rank, mb))

        for k in range(warmup):
            run(k, Kind.FORWARD)
        for i in range(total - warmup):
            run(warmup + i, Kind.FORWARD)
            run(i, Kind.BACKWARD)
        for i in range(total - warmup, total):
            run(i, Kind.BACKWARD)
        order += [Action(Kind.STEP, chunk * p + rank) for chunk in range(v)]
        orders.append(order)
    return Generated(orders, [(stage % p,) for stage in range(p * v)])


def check(ranks: int, microbatches: int, replicas: Sequence[int] | None, options: Options) -> None:
    """Micro-batches must come in groups of ``ranks``, as Megatron-LM's order needs."""
    if microbatches % ranks:
        raise ValueError(
            f"interleaved needs microbatches to be a multiple of ranks ({ranks}), "
            f"got {microbatches}"
        )


def in_flight(stage: int, microbatches: int, replicas: Sequence[int], chunks: int) -> int:
    """Chunk micro-batches a rank holds: Megatron-LM's warm-up depth plus one."""
    ranks = len(replicas)
    return min((ranks - stage - 1) * 2 + (chunks - 1) * ranks + 1, chunks * microbatches)


def bubble(ranks: int, microbatches: int, options: Options, costs: UniformCosts) -> Bubble:
    """Each rank's fill and drain is one chunk long: (p − 1) / (v·m + p − 1)."""
    v = int(options["virtual"])
    return "(p-1)/(v*m+p-1)", (ranks - 1) / (v * microbatches + ranks - 1)


SPEC = ScheduleSpec(
    name="interleaved",
    summary="interleaved 1F1B: several model chunks per rank; one synchronous update",
    generate=generate,
    options=(Option("virtual", 2, "model chunks per rank", minimum=2),),
    check=check,
    chunk_option="virtual",
    in_flight=in_flight,
    textbook_bubble=bubble,
    planned_by_default=True,
)
