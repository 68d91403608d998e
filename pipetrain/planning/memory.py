"""Peak memory of one worker of a pipeline stage, per schedule.

A worker holds its stage's weights (several versions under weight stashing), one gradient
buffer, the optimizer state, and the activations of the micro-batches in flight:

``peak = versions·|W| + |W| (gradients) + |optimizer| + activations + workspace + sent``

A replicated stage of a synchronous schedule counts its gradients as they exist at the
activations' peak, as a sharded stage does (below): the runtime clears them as a call
starts, so ``|W|`` where a forward follows a backward on the worker, else
``max(0, |W| − kept)`` (GPipe's peak comes before any backward; counting ``|W|`` predicted
its peaks 13% high). It also meets the all-reduce at the step's end, when the gradients'
flat copy in the reducer's buckets is alive with them: ``3|W| + |optimizer| + sent``, where
that is higher (every rank of 2 stages x 2 replicas measured within 4%, under 1F1B and
GPipe, and within 1% where weights outweigh activations:
``benchmarks/bench_shard_memory.py --peaks``). A stage without replicas keeps ``|W|``
through the step: the depth-scaling figures it was checked against were measured with the
last update's gradients kept alive.

The gradient buffer is left out where an asynchronous schedule updates after every
micro-batch (``pipedream``): its update frees the gradients right after the backward that
made them, so they never meet the in-flight activations at the peak.

where, with ``n`` micro-batches in flight on the worker, ``A`` one micro-batch's stored
activations of the stage (its input plus what every layer keeps for its backward: the
tensors autograd saves and the output, as profiled) and ``I`` its input alone,

- without recomputation: ``activations = n · A``;
- with recomputation: ``activations = n · I + A`` (only stage inputs are kept; one
  micro-batch is re-materialised at a time during its backward);
  Under a split backward the B re-materialises, and what it made stays until the W:
  ``activations = n · I + d · A`` with ``d`` the most micro-batches between their B and
  their W at once, read from the schedule's order;
- ``workspace`` is the largest one layer keeps for one micro-batch: a layer's backward
  holds the gradients of what it saved, about as large, while all the rest is still kept;
- ``sent`` is what the worker has sent by then: a send's buffer lives until the step's
  end, when the runtime waits for all of them (gloo completes a send only once it is
  waited for), so the peak comes late in the step, when every forward has sent its
  output and every backward but the ``n`` held micro-batches' its input gradient.

A stage sharded over its ``r`` replicas (``PipelineConfig(shard=True)``, FSDP2) keeps its
shards of the weights and of the optimizer state, ``shards = (|W| + |optimizer|) / r``,
through a step; the last update's gradient shards are dropped as the call starts. The
runtime gathers the weights whole before the first forward and keeps them gathered until
the reduce-scatter after the last backward, while the backwards accumulate whole, unsharded
gradients, so the peak is the larger of two moments (measured on every rank of 2 stages x 2
sharded replicas within 5%: ``benchmarks/bench_shard_memory.py --peaks``):

``shards + |W| (gathered) + activations + workspace + sent + unsharded`` where
``unsharded = |W|`` if a forward follows a backward on the worker (the gradients of the
first backward meet ``n`` micro-batches again), else ``max(0, |W| − kept)`` (they grow as
the first backward frees one micro-batch's ``kept`` activations); and the reduce-scatter:
``shards + 2|W| + |W|/r + sent`` (the whole gradients, their flat copy the collective sends
and the new shard, after the gathered weights are freed).

These are the GPipe and PipeDream-2BW formulas of ANCHORS.md per stage: GPipe with
recomputation ``|W|/d + |A_total(b)|/d + m·|A_input(b)|`` (``n = m``); 2BW
``2|W|/d + |A_total(b)|/d + d·|A_input(b)|`` (two versions, ``n ≤ d``).

In-flight micro-batches ``n`` and weight versions come from each schedule's spec
(:class:`pipetrain.schedules.ScheduleSpec`): for example ``gpipe`` holds all of a worker's
``⌈m / r_s⌉`` micro-batches, the 1F1B family at most PipeDream's in-flight depth
``⌈(r_s + … + r_{p-1}) / r_s⌉``, ``interleaved`` Megatron-LM's warm-up depth, the V
families, ``zb-h1`` and ``interleaved-zb`` the peak of their own orders (until each W); ``2bw``
keeps 2 weight versions, ``pipedream`` one per in-flight mini-batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from pipetrain.profiler.costs import Profile
from pipetrain.schedules import Kind, spec
from pipetrain.schedules.builtin.unit_time import peak_held


@dataclass(frozen=True)
class StageFootprint:
    """What one stage (or chunk) stores, per micro-batch where it applies:
    ``activation_bytes`` all it keeps for the backward, ``input_bytes`` its input alone and
    ``workspace_bytes`` the most that one of its layers keeps (what that layer's backward
    holds again as gradients); what it sends: ``output_bytes`` (none from the last stage)
    and its input's gradient, ``gradient_bytes`` (none from the first)."""

    parameter_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    input_bytes: float
    workspace_bytes: float = 0.0
    output_bytes: float = 0.0
    gradient_bytes: float = 0.0

    @classmethod
    def of(cls, profile: Profile, start: int, stop: int) -> StageFootprint:
        """Footprint of layers ``start..stop-1``: the stage input plus what each layer keeps
        for its backward (its saved tensors where profiled, else its output) are stored."""
        layers = profile.layers[start:stop]
        stage_input = (
            profile.input_bytes if start == 0 else profile.layers[start - 1].activation_bytes
        )
        kept = [
            layer.activation_bytes if layer.saved_bytes is None else layer.saved_bytes
            for layer in layers
        ]
        return cls(
            parameter_bytes=sum(layer.parameter_bytes for layer in layers),
            optimizer_bytes=sum(layer.optimizer_bytes for layer in layers),
            activation_bytes=stage_input + sum(kept),
            input_bytes=stage_input,
            workspace_bytes=max(kept, default=0.0),
            output_bytes=profile.layers[stop - 1].activation_bytes
            if 0 < stop < len(profile.layers)
            else 0.0,
            gradient_bytes=stage_input if start > 0 else 0.0,
        )


def in_flight(
    schedule: str,
    stage: int,
    microbatches: int,
    replicas: Sequence[int],
    virtual: int = 1,
) -> int:
    """Micro-batches (chunk micro-batches when chunked) a worker of ``stage`` holds at once,
    by the schedule's memory model (all of its micro-batches if the spec gives none).

    ``replicas`` has one entry per stage (per rank for chunked schedules).
    """
    family = spec(schedule)
    if family.in_flight is None:
        return math.ceil(microbatches / replicas[stage]) * virtual
    return family.in_flight(stage, microbatches, replicas, virtual)


@lru_cache(maxsize=256)
def deferred_weights(schedule: str, ranks: int, microbatches: int, virtual: int) -> tuple[int, ...]:
    """Per rank, the most (chunk) micro-batches whose B has run and whose W has not, at
    once, in the order of ``schedule`` on ``ranks`` ranks (``virtual`` chunks each): its
    written order, which lowering keeps."""
    family = spec(schedule)
    options: dict[str, int | bool] = {family.chunk_option: virtual} if family.chunk_option else {}
    written = family.generate(ranks, microbatches, None, family.resolve(options)).orders
    return tuple(peak_held(written, since=Kind.BACKWARD))


def worker_memory(
    chunks: Sequence[StageFootprint],
    recompute: Sequence[bool],
    schedule: str,
    stage: int,
    microbatches: int,
    replicas: Sequence[int],
    shard: bool = False,
) -> float:
    """Peak bytes on one worker of ``stage`` (see the module docstring for the formula).

    ``chunks`` are the stage's footprints: one, or the ``v`` chunks of a rank under a
    schedule with chunks; ``recompute[i]`` says whether chunk ``i`` re-materialises its
    activations in the backward. With ``shard``, a stage of several replicas holds shards
    (one chunk per worker, a synchronous schedule).
    """
    if len(chunks) != len(recompute) or not chunks:
        raise ValueError("give one recompute flag per chunk, and at least one chunk")
    if shard and len(chunks) > 1:
        raise ValueError("a sharded stage is one chunk per worker; give one footprint")
    weights = sum(chunk.parameter_bytes for chunk in chunks)
    optimizer = sum(chunk.optimizer_bytes for chunk in chunks)
    count = in_flight(schedule, stage, microbatches, replicas, virtual=len(chunks))
    kept = sum(
        chunk.input_bytes if again else chunk.activation_bytes
        for chunk, again in zip(chunks, recompute)
    )
    rematerialised = max(
        (c.activation_bytes for c, again in zip(chunks, recompute) if again), default=0.0
    )
    family = spec(schedule)
    options = family.resolve({})
    if rematerialised and family.split_backward:
        ranks, virtual = len(replicas), len(chunks)
        rematerialised *= max(deferred_weights(schedule, ranks, microbatches, virtual)[stage], 1)
    activations = count * kept / len(chunks) + rematerialised
    workspace = max(chunk.workspace_bytes for chunk in chunks)
    window = math.ceil(family.window(microbatches, options) / replicas[stage])
    # at the peak every forward of the step has sent its output, and every backward but
    # those of the micro-batches still held its gradient
    gradients_sent = max(window * len(chunks) - count, 0) / len(chunks)
    sent = sum(window * c.output_bytes + gradients_sent * c.gradient_bytes for c in chunks)
    # whole gradients at the activations' peak: cleared as the call starts, they exist from
    # the first backward on; a forward after a backward meets them with n micro-batches,
    # else they grow as the first backward frees one micro-batch's activations
    refilled = count < window
    growing = weights if refilled else max(0.0, weights - kept)
    if shard and replicas[stage] > 1:
        shards = (weights + optimizer) / replicas[stage]
        during = shards + weights + growing + activations + workspace + sent
        reduce_scatter = shards + 2 * weights + weights / replicas[stage] + sent
        return max(during, reduce_scatter)
    versions = family.weight_versions(stage, replicas, options)
    freed = family.asynchronous and family.per_update(microbatches, options) == 1
    gradients = 0.0 if freed else weights
    if replicas[stage] > 1 and not family.asynchronous:
        gradients = growing  # as measured; one copy is counted through the step (see above)
    peak = versions * weights + gradients + optimizer + activations + workspace + sent
    if replicas[stage] > 1 and not family.asynchronous:
        # the all-reduce at the step's end: the gradients' flat copy in its buckets
        peak = max(peak, 3 * weights + optimizer + sent)
    return peak
