"""RoundPipe (Luo et al., 2026, arXiv 2604.27085): stateless workers fed round-robin from a
host weight store; one synchronous update, or with ``stale=True`` updates one step stale.

The model is cut into ``model_stages`` S ≥ N stages for N workers (default 2N). Stage s's
forward for every micro-batch runs on rank s mod N, so the pipeline wraps around (stage N
runs on rank 0 after stage N − 1 on rank N − 1), and the backwards run the same way in
reverse. No worker owns a stage: before it computes on stage s it loads the weights from
the host store (``LOAD s``) and afterwards frees them (``OFFLOAD s``), handing back the
gradients once the stage's backwards have run there; the host steps each stage's
optimizer as its gradients arrive, so the workers write no ``STEP``
(:mod:`~pipetrain.schedules.residency`). With ``resident=2`` (the default: RoundPipe
prefetches one stage) a rank loads the stage it runs next while the current one computes;
with ``resident=1`` it loads each stage just before its passes.

Placement of the backward. RoundPipe deals each stage's job (all of its micro-batches) to
the next GPU of one round-robin counter running through the forward stages, the last
stage's fused forward and backward, and then the backward stages, so a stage's backward
usually lands on another GPU than its forward; the stage's input is stashed in host memory
during the forward and the backward recomputes the stage from it. Here a stage's backward
runs on the rank of its forward (s mod N): its activations stay where they were made, with
no recomputation and no activation traffic to the host, and pipetrain's rule that a
micro-batch's passes of a stage share one rank holds. A rank's highest stage keeps its
weights from its forwards to its backwards (one ``LOAD``, as RoundPipe's fused last
stage). The price: a rank holds its stages' activations from forward to backward, where
RoundPipe keeps only stage inputs, in host memory; and at the turn a rank waits for the
backward to come back down the ranks (looped BFS's bubble: with S a multiple of N the
passes are looped BFS's, in the same order), where RoundPipe's counter hands the next
backward to the next GPU in turn, paying a recomputation of every stage's forward
instead.

With ``stale=True`` the schedule is the same; the runtime applies update k's optimizer
step to the host store during update k + 1, once that update's loads have read the weights
(:mod:`~pipetrain.runtime.rank.stale_store`): per stage w_{t+1} = step(w_t, g(w_{t-1})),
RoundPipe's optional stale update, which overlaps the optimizer with the next step.

RoundPipe also cuts the backward differently from the forward (``ModelExecutePlan``'s
separate layer ranges); here both use the same S stages.
"""

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


def model_stages(ranks: int, options: Options) -> int:
    """The stages S the model is cut into: ``model_stages``, or twice the ranks if 0."""
    return int(options["model_stages"]) or 2 * ranks


def generate(
    ranks: int, microbatches: int, replicas: Sequence[int] | None, options: Options
) -> Generated:
    """Rank ``r`` runs stages ``r, r + N, …`` forward, then the same backward in reverse,
    each stage's passes for every micro-batch between its ``LOAD`` and its ``OFFLOAD``
    (its highest stage's forwards and backwards in one residency); with ``resident=2``,
    the next residency's ``LOAD`` is written before the current one's passes."""
    stages, prefetch = model_stages(ranks, options), options["resident"] == 2
    every = shared_ints(microbatches)
    orders = []
    for rank in range(ranks):
        held = list(range(rank, stages, ranks))
        top = held.pop()
        visits = [(s, [Action(Kind.FORWARD, s, k) for k in every]) for s in held]
        both = [Kind.FORWARD, Kind.BACKWARD]
        visits.append((top, [Action(kind, top, k) for kind in both for k in every]))
        visits += [(s, [Action(Kind.BACKWARD, s, k) for k in every]) for s in reversed(held)]
        order = [Action(Kind.LOAD, visits[0][0])] if prefetch else []
        for index, (stage, passes) in enumerate(visits):
            if not prefetch:
                order.append(Action(Kind.LOAD, stage))
            elif index + 1 < len(visits):
                order.append(Action(Kind.LOAD, visits[index + 1][0]))
            order += passes
            order.append(Action(Kind.OFFLOAD, stage))
        orders.append(order)
    facts = {"model_stages": stages}
    return Generated(orders, [(stage % ranks,) for stage in range(stages)], facts)


def check(ranks: int, microbatches: int, replicas: Sequence[int] | None, options: Options) -> None:
    """At least one stage per rank, so every worker takes a turn; a prefetch of at most
    one stage ahead."""
    stages = model_stages(ranks, options)
    if stages < ranks:
        raise ValueError(
            f"roundpipe deals model_stages={stages} stages over {ranks} ranks; give "
            f"model_stages of at least {ranks}, or fewer ranks"
        )
    if options["resident"] > 2:
        raise ValueError(
            f"roundpipe prefetches at most the next stage, got resident={options['resident']}; "
            "give resident=2 (prefetch) or 1 (none)"
        )


def bubble(ranks: int, microbatches: int, options: Options, costs: UniformCosts) -> Bubble | None:
    """With S = v·N stages and m ≥ N, the passes are looped BFS's: (p − 1) / (v·m + p − 1)
    (stage weights loaded and returned in no time)."""
    stages = model_stages(ranks, options)
    if stages % ranks or microbatches < ranks:
        return None
    v = stages // ranks
    return "(p-1)/(v*m+p-1)", (ranks - 1) / (v * microbatches + ranks - 1)


SPEC = ScheduleSpec(
    name="roundpipe",
    summary="RoundPipe: stages dealt round-robin to workers that load their weights from a "
    "host store and return the gradients; synchronous updates, or one step stale with "
    "stale=True (not planned yet)",
    generate=generate,
    options=(
        Option(
            "model_stages",
            0,
            "model stages dealt round-robin over the ranks, at least the ranks; 0 deals twice "
            "the ranks",
            minimum=0,
        ),
        Option(
            "resident",
            2,
            "stages a rank holds at once: 2 loads the next stage's weights while the current "
            "one computes, 1 loads each just before its passes",
        ),
        Option(
            "stale",
            False,
            "one-step-stale updates: update k's optimizer step is applied to the host store "
            "during update k+1, after its loads read the weights (w_{t+1} = w_t - "
            "lr*g(w_{t-1})); default: synchronous",
        ),
    ),
    check=check,
    textbook_bubble=bubble,
    planned_by_default=True,
    host_weights=True,
)
