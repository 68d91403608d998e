"""A schedule whose weights live in a host store (``roundpipe``): a worker's working set,
the host store's size, and the stages' traffic over the workers' links to the host.

A worker of such a schedule owns no stage. Rank ``r`` of ``N`` runs stages ``r, r + N, …``
(its *stages*, in order): their forwards going up, its highest stage's forwards and
backwards in one residency, then the backwards coming down. Between a stage's ``LOAD``
and its ``OFFLOAD`` the worker holds its weights and, once its backwards run, their
gradients; the optimizer state lives on the host, which steps. At the turn (every forward
of every stage done, no backward yet) the worker holds the activations of all of its
stages' micro-batches, since a stage's backward runs on its forward's rank. So, with ``m``
micro-batches, ``A_s`` one micro-batch's stored activations of stage ``s`` (its input and
what its layers keep), ``I_s`` its input alone and ``O_s`` its output:

``peak = resident + activations + workspace + sent``

- ``resident``: the weights and gradients, ``2·|W|``, of the most bytes that ``resident``
  consecutive stages of the rank hold together (1: one stage at a time; 2, the default:
  the next stage's weights are loaded while the current one computes), counted whole at
  the turn as the other schedules' model counts a stage's gradients through the step;
- ``activations = m · Σ_s A_s`` without recomputation, ``m · Σ_s I_s + max_s A_s`` with it
  (only stage inputs are kept; one micro-batch's stage is re-materialised at a time); under
  ``except_last`` each stage's last micro-batch keeps its activations whole until its
  backward, which comes after the turn: ``+ Σ_s (A_s − I_s)``;
- ``workspace``: the most one layer of the rank's stages keeps for one micro-batch (its
  backward holds gradients about as large), as for the other schedules;
- ``sent = m · Σ_s O_s``: at the turn every forward has sent its output to the next rank
  and no backward has sent a gradient; a send's buffer lives until the step's end (a rank
  that runs every stage, ``N = 1``, sends nothing).

After the turn each backward frees a micro-batch's ``A_s`` and sends its ``I_s ≤ A_s``,
so the worker's memory only falls from there, but for the next stage's weights.

The host store holds the whole model once: weights (the fp32 master: the runtime keeps
fp32 weights and autocasts the compute), their gradients and the optimizer state,
``Σ (2·|W| + |optimizer|)`` over the layers (:func:`host_store_bytes`).

Each worker reaches the host store over a link of its own (``host_link`` bytes/s each
way): a stage's ``LOAD`` carries its weights, ``|W| / host_link``; its ``OFFLOAD`` after
its backwards carries the gradients back, as many bytes (:func:`host_link_costs`). The
simulator overlaps both with compute, as a GPU's copy engine does. The optimizer step over
the stage's part of the store is the worker's compute (the planner adds it to the stage's
backwards, :class:`~pipetrain.planning.candidates.Candidate`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from pipetrain.planning.memory import StageFootprint
from pipetrain.profiler.costs import Profile

STAGES_OPTION, RESIDENT_OPTION = "model_stages", "resident"
"""The options of a family whose weights live in a host store: the stages it deals over the
workers, and how many a worker holds at once."""

DEFAULT_HOST_BANDWIDTH = 10e9
"""Bytes/s of each worker's link to the host store where none is given: a CPU worker
copying a stage out of the node's shared memory (memcpy-class, 10 GB/s). For GPU workers
give their PCIe link's: about 25e9 for PCIe 4.0 x16 from pinned memory, 12e9 for 3.0."""


def rank_stages(stages: int, ranks: int, rank: int) -> list[int]:
    """The stages ``rank`` runs when ``stages`` stages are dealt round-robin over ``ranks``
    ranks (stage ``s`` on rank ``s mod ranks``), in increasing order."""
    return list(range(rank, stages, ranks))


def resident_bytes(footprints: Sequence[StageFootprint], resident: int) -> float:
    """Weights and gradients of the most bytes ``resident`` consecutive stages of
    ``footprints`` (one rank's stages, in order) hold at once."""
    held = [2 * footprint.parameter_bytes for footprint in footprints]
    window = min(resident, len(held))
    return max(sum(held[start : start + window]) for start in range(len(held) - window + 1))


def host_worker_memory(
    footprints: Sequence[StageFootprint],
    recompute: Sequence[bool],
    microbatches: int,
    resident: int,
    sends: bool = True,
    keeps_last: bool = False,
) -> float:
    """Peak bytes on one worker running the stages ``footprints`` (its stages, in order)
    for ``microbatches`` micro-batches, with ``resident`` stages held at once (see the
    module docstring); ``recompute[i]`` says whether stage ``i`` re-materialises its
    activations in the backward, ``keeps_last`` that its last micro-batch does not
    (``except_last``); ``sends``: its forwards' outputs go to another rank."""
    if not footprints or len(footprints) != len(recompute):
        raise ValueError("give one recompute flag per stage, and at least one stage")
    if resident < 1:
        raise ValueError(f"a worker holds at least one stage at once, got resident={resident}")
    pairs = list(zip(footprints, recompute))
    kept = sum(stage.input_bytes if again else stage.activation_bytes for stage, again in pairs)
    rematerialised = max((stage.activation_bytes for stage, again in pairs if again), default=0.0)
    activations = microbatches * kept + rematerialised
    if keeps_last:
        activations += sum(
            stage.activation_bytes - stage.input_bytes for stage, again in pairs if again
        )
    workspace = max(stage.workspace_bytes for stage in footprints)
    sent = microbatches * sum(stage.output_bytes for stage in footprints) if sends else 0.0
    return resident_bytes(footprints, resident) + activations + workspace + sent


def dealt_memory(
    footprints: Sequence[StageFootprint],
    recompute: Sequence[bool],
    ranks: int,
    microbatches: int,
    resident: int,
    keeps_last: bool = False,
) -> list[float]:
    """Per stage of ``footprints`` (all of the model's, dealt round-robin over ``ranks``
    workers), the peak of the worker it is dealt to (:func:`host_worker_memory`)."""
    per_rank = []
    for rank in range(ranks):
        held = rank_stages(len(footprints), ranks, rank)
        per_rank.append(
            host_worker_memory(
                [footprints[s] for s in held],
                [recompute[s] for s in held],
                microbatches,
                resident,
                sends=ranks > 1,
                keeps_last=keeps_last,
            )
        )
    return [per_rank[stage % ranks] for stage in range(len(footprints))]


def balanced_peaks(
    profile: Profile,
    balance: Sequence[int],
    ranks: int,
    microbatches: int,
    resident: int,
    recompute: str = "never",
) -> list[float]:
    """Per rank, the working-set peak of a schedule dealing stages of ``balance`` layers
    each (in order, adding up to the profile's layers) over ``ranks`` ranks, for
    ``microbatches`` micro-batches of the profile's size, ``resident`` stages held at once
    and every stage re-materialised in its backward as the ``recompute`` mode says
    (``never``, ``always`` or ``except_last``)."""
    if sum(balance) != len(profile.layers) or min(balance, default=0) < 1:
        raise ValueError(
            f"a balance of {list(balance)} does not split the profile's "
            f"{len(profile.layers)} layers into stages of at least one layer each"
        )
    bounds = [sum(balance[:index]) for index in range(len(balance) + 1)]
    footprints = [StageFootprint.of(profile, a, b) for a, b in itertools.pairwise(bounds)]
    flags = [recompute != "never"] * len(balance)
    keeps_last = recompute == "except_last"
    peaks = dealt_memory(footprints, flags, ranks, microbatches, resident, keeps_last)
    return [peaks[rank] for rank in range(min(ranks, len(balance)))]


def host_link_costs(
    profile: Profile, stages: Sequence[tuple[int, int]], link: float | None
) -> tuple[list[float], list[float]]:
    """Per stage (layers ``start..stop-1``), the seconds its weights take from the host
    over a link of ``link`` bytes/s (``Costs.load_s``), and its gradients back
    (``Costs.offload_s``, as many bytes); nothing without a host store (``link`` None)."""
    if link is None:
        return [0.0] * len(stages), [0.0] * len(stages)
    load = [
        sum(layer.parameter_bytes for layer in profile.layers[start:stop]) / link
        for start, stop in stages
    ]
    return load, list(load)


def host_store_bytes(profile: Profile) -> float:
    """Bytes the host store holds: the whole model's weights, gradients and optimizer
    state, once."""
    return sum(2 * layer.parameter_bytes + layer.optimizer_bytes for layer in profile.layers)
