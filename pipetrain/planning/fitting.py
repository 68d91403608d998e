"""The candidates the planner simulates: for each micro-batch count, the stage layouts of
the topology (each with replicated stages also with their replicas holding shards), each with
every schedule that runs it at the micro-batch size its step plays, and the cheapest
recomputation mode that fits the memory limit."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Literal

from pipetrain.planning.candidates import Candidate, step_costs
from pipetrain.planning.layouts import Layout, layouts
from pipetrain.planning.topology import Topology
from pipetrain.planning.verdicts import Verdicts
from pipetrain.profiler.costs import Profile
from pipetrain.schedules import RECOMPUTE_MODES, spec
from pipetrain.units import counted


def fitting_candidates(
    profile: Profile,
    topology: Topology,
    schedules: tuple[str, ...],
    counts: list[int],
    batch_size: int | None,
    replication: bool,
    memory_limit: float | None,
    report: Callable[[str], None],
    verdicts: Verdicts,
    every_worker: bool,
    shard: bool | Literal["only"] = False,
    host_link: float | None = None,
) -> tuple[list[tuple[Candidate, list[float]]], tuple[float, Candidate | None]]:
    """Candidates that fit with their memory, and the smallest peak among those that do not;
    each tried candidate goes to ``verdicts``. With ``shard``, a layout with replicated
    stages is tried with shards too; with ``"only"``, only with shards. A family whose
    weights live in a host store gets its own layouts, loaded over ``host_link`` bytes/s;
    with a ``batch_size``, only at the counts :func:`_host_counts` keeps."""
    hosted = any(spec(name).host_weights for name in schedules)
    host_counts = _host_counts(counts, topology.workers, batch_size)
    fitting: list[tuple[Candidate, list[float]]] = []
    smallest: tuple[float, Candidate | None] = (math.inf, None)
    layouts_by_batch: dict[int, list[Layout]] = {}
    for index, count in enumerate(counts):
        for size, runnable in _by_microbatch_size(profile, schedules, count, batch_size):
            micro = profile if size == profile.microbatch_size else profile.scaled(size)
            step_batch = size * count
            if step_batch not in layouts_by_batch:
                report(
                    f"planning: stage layouts for "
                    f"{counted(count, 'micro-batch', 'micro-batches')} ({index + 1}/{len(counts)})"
                )
                found = layouts(
                    step_costs(micro, count),
                    topology,
                    replication,
                    any(spec(name).chunk_option for name in schedules),
                    host_link if hosted else None,
                )
                sharded = _sharded(found) if shard else []
                layouts_by_batch[step_batch] = sharded if shard == "only" else found + sharded
            for layout in layouts_by_batch[step_batch]:
                if every_worker and layout.workers != topology.workers:
                    continue
                for schedule in runnable:
                    if not layout.runs(schedule, count) or (
                        layout.host_link is not None and count not in host_counts
                    ):
                        continue
                    fit, unfit = _cheapest_recompute(
                        [
                            Candidate(layout, schedule, count, mode, micro)
                            for mode in RECOMPUTE_MODES
                        ],
                        memory_limit,
                        verdicts,
                    )
                    if fit is not None:
                        fitting.append(fit)
                    smallest = min([smallest, *unfit], key=lambda pair: pair[0])
    return fitting, smallest


def _host_counts(counts: list[int], workers: int, batch_size: int | None) -> list[int]:
    """The micro-batch counts a family whose weights live in a host store is tried at.

    Its workers hold every micro-batch of the step at once, so with a fixed ``batch_size``
    cutting it into fewer micro-batches saves no memory (the same activations, in fewer
    pieces, and a larger workspace), while fewer than the ``workers`` leave each worker
    waiting at the wrap-around: only the counts of at least ``workers`` are tried (the
    largest where none is that many). Without a batch size every count is."""
    if batch_size is None:
        return counts
    return [count for count in counts if count >= min(workers, max(counts))]


def _sharded(found: list[Layout]) -> list[Layout]:
    """The layouts of ``found`` with a replicated stage, their replicas holding shards."""
    return [
        replace(layout, shard=True)
        for layout in found
        if layout.virtual == 1 and max(layout.replicas) > 1 and layout.host_link is None
    ]


def _cheapest_recompute(
    candidates: list[Candidate], memory_limit: float | None, verdicts: Verdicts
) -> tuple[tuple[Candidate, list[float]] | None, list[tuple[float, Candidate | None]]]:
    """The first of ``candidates`` (one per recomputation mode, cheapest first) that fits
    ``memory_limit``, with its memory, and the peaks of those tried before it that do not;
    modes that recompute the same stages and keep as much are tried once, and each try
    goes to ``verdicts``."""
    seen: set[tuple[tuple[bool, ...], bool]] = set()
    unfit: list[tuple[float, Candidate | None]] = []
    for candidate in candidates:
        key = (tuple(candidate.recompute_flags), candidate.keeps_last)
        if key in seen:
            continue
        seen.add(key)
        memory = candidate.memory()
        fits = memory_limit is None or max(memory) <= memory_limit
        verdicts.tried(candidate, max(memory), fits)
        if fits:
            return (candidate, memory), unfit
        unfit.append((max(memory), candidate))
    return None, unfit


def _by_microbatch_size(
    profile: Profile, schedules: tuple[str, ...], count: int, batch_size: int | None
) -> list[tuple[int, list[str]]]:
    """The schedules grouped by the micro-batch size they run ``count`` micro-batches per
    update at: the profile's, or with ``batch_size`` the samples of one training step over
    the micro-batches that step plays (its window: ``2bw`` makes two updates a step), in
    first-seen order; a schedule whose window does not divide ``batch_size`` is left out."""
    groups: dict[int, list[str]] = {}
    for schedule in schedules:
        family = spec(schedule)
        window = family.window(count, family.resolve({}))
        if batch_size is None:
            size = profile.microbatch_size
        elif batch_size % window == 0:
            size = batch_size // window
        else:
            continue
        groups.setdefault(size, []).append(schedule)
    return list(groups.items())
