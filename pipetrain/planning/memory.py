"""Peak memory of one worker of a pipeline stage, per schedule.

A worker holds its stage's weights (several versions under weight stashing), one gradient
buffer, the optimizer state, and the activations of the micro-batches in flight:

``peak = versions·|W| + |W| (gradients) + |optimizer| + activations``

where, with ``n`` micro-batches in flight on the worker, ``A`` one micro-batch's stored
activations of the stage (its input plus every layer's output) and ``I`` its input alone,

- without recomputation: ``activations = n · A``;
- with recomputation: ``activations = n · I + A`` (only stage inputs are kept; one
  micro-batch is re-materialised at a time during its backward).

These are the GPipe and PipeDream-2BW formulas of ANCHORS.md per stage: GPipe with
recomputation ``|W|/d + |A_total(b)|/d + m·|A_input(b)|`` (``n = m``); 2BW
``2|W|/d + |A_total(b)|/d + d·|A_input(b)|`` (two versions, ``n ≤ d``).

In-flight micro-batches ``n`` on a worker of stage ``s`` (``p`` stages, ``m`` micro-batches,
``r_s`` replicas, micro-batches dealt round-robin to replicas, so a replica runs
``⌈m / r_s⌉``):

- ``gpipe``: all of them, ``⌈m / r_s⌉``;
- ``1f1b``, ``zb-h1``, ``pipedream``, ``2bw``: at most PipeDream's in-flight depth
  ``⌈(r_s + … + r_{p-1}) / r_s⌉`` (``p - s`` without replication);
- ``interleaved`` (``v`` chunks per rank, counted in chunk micro-batches):
  ``min((p - s - 1)·2 + (v - 1)·p + 1, v·m)`` as in Megatron-LM's warm-up.

Weight versions: 2 for ``2bw``, the in-flight depth for ``pipedream`` (one stashed version
per in-flight mini-batch), 1 otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipetrain.profiler.costs import Profile
from pipetrain.schedules.generators import in_flight_limit

ONE_F_ONE_B_LIKE = ("1f1b", "zb-h1", "pipedream", "2bw")


@dataclass(frozen=True)
class StageFootprint:
    """What one stage (or interleaved chunk) stores, per micro-batch where it applies."""

    parameter_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    input_bytes: float

    @classmethod
    def of(cls, profile: Profile, start: int, stop: int) -> StageFootprint:
        """Footprint of layers ``start..stop-1``: input plus layer outputs are stored."""
        layers = profile.layers[start:stop]
        stage_input = (
            profile.input_bytes if start == 0 else profile.layers[start - 1].activation_bytes
        )
        return cls(
            parameter_bytes=sum(layer.parameter_bytes for layer in layers),
            optimizer_bytes=sum(layer.optimizer_bytes for layer in layers),
            activation_bytes=stage_input + sum(layer.activation_bytes for layer in layers),
            input_bytes=stage_input,
        )


def in_flight(
    schedule: str,
    stage: int,
    microbatches: int,
    replicas: Sequence[int],
    virtual: int = 1,
) -> int:
    """Micro-batches (chunk micro-batches for ``interleaved``) a worker of ``stage`` holds at once.

    ``replicas`` has one entry per stage (per rank for ``interleaved``).
    """
    local = math.ceil(microbatches / replicas[stage])
    if schedule == "gpipe":
        return local
    if schedule in ONE_F_ONE_B_LIKE:
        return min(local, in_flight_limit(replicas, stage))
    if schedule == "interleaved":
        ranks = len(replicas)
        return min((ranks - stage - 1) * 2 + (virtual - 1) * ranks + 1, virtual * microbatches)
    raise ValueError(f"no memory model for schedule {schedule!r}")


def weight_versions(schedule: str, stage: int, replicas: Sequence[int]) -> int:
    """Weight copies a worker keeps: 2 for 2bw, the in-flight depth for pipedream, else 1."""
    if schedule == "2bw":
        return 2
    if schedule == "pipedream":
        return in_flight_limit(replicas, stage)
    return 1


def worker_memory(
    chunks: Sequence[StageFootprint],
    recompute: Sequence[bool],
    schedule: str,
    stage: int,
    microbatches: int,
    replicas: Sequence[int],
) -> float:
    """Peak bytes on one worker of ``stage`` (see the module docstring for the formula).

    ``chunks`` are the stage's footprints: one, or the ``v`` chunks of a rank under
    ``interleaved``; ``recompute[i]`` says whether chunk ``i`` re-materialises its
    activations in the backward.
    """
    if len(chunks) != len(recompute) or not chunks:
        raise ValueError("give one recompute flag per chunk, and at least one chunk")
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
    activations = count * kept / len(chunks) + rematerialised
    return weight_versions(schedule, stage, replicas) * weights + weights + optimizer + activations
