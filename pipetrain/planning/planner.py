"""Choose a pipeline plan: stages, replicas, schedule, micro-batches and recomputation.

:func:`plan` builds candidate layouts (PipeDream's replicated pipeline, a straight pipeline,
one with two chunks per worker), keeps the configurations whose per-worker memory fits,
simulates them on the profiled costs with :mod:`pipetrain.simulate`, and returns the fastest
as a :class:`Plan`, with the reason each other schedule lost. The replication planner
proposes layouts under PipeDream's cost model, in which an all-reduce overlaps compute; the
simulation then prices every candidate as its schedule runs it (the all-reduce after the
last backward), and decides. The chosen plan's predicted step then allows for the run-to-run
variation the profile measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

from pipetrain.planning.candidates import Candidate
from pipetrain.planning.fitting import fitting_candidates
from pipetrain.planning.result import Plan, PlanStage
from pipetrain.planning.topology import Topology, resolve
from pipetrain.planning.verdicts import Verdicts
from pipetrain.profiler.costs import Profile
from pipetrain.schedules import names, spec
from pipetrain.simulation import Costs, Variation, median_makespan
from pipetrain.units import counted, format_bytes

DEFAULT_MICROBATCHES = (1, 2, 4, 8, 16, 32, 64)

VARIED_RUNS = (5, 64)
"""The fewest and most simulated steps whose median is a measured profile's predicted step."""

_VARIED_ACTIONS = (
    150_000  # actions simulated for the varied steps (about a second), where the counts allow
)

FEWER_WITHIN = 0.05
"""Among the candidates whose predicted throughput is within this fraction of the fastest's,
the one with the fewest stages wins, then the one with the fewest micro-batches. Every
stage boundary and every micro-batch costs the runtime what the profile leaves out (its
messages' and actions' dispatch, more workers busy at once on shared cores), and
predictions are good to about this much: so pipeline only where it clearly pays. On four
workers sharing two cores, data parallelism with 8 micro-batches predicted within 3% of 2
reached its target 11-20% later than DDP where 2 came within 5% of it; a VGG split into
four straight stages and one into three with a replicated middle were predicted within 3%
of each other, and which ran depended on the profile's noise."""


MAX_LAYERS = 8192
"""The most layers :func:`plan` takes: planning 16 workers takes 6 s and 0.2 GB for 4,000
layers, 73 s and 2.8 GB for 16,000 on a 2-core machine, growing with the square."""


def plan(
    profile: Profile,
    workers: int | None = None,
    topology: Topology | str | None = None,
    memory_limit: float | None = None,
    schedules: Sequence[str] | None = None,
    microbatches: Sequence[int] = DEFAULT_MICROBATCHES,
    batch_size: int | None = None,
    replication: bool = True,
    progress: Callable[[str], None] | None = None,
    every_worker: bool = False,
    shared_cores: int | None = None,
) -> Plan:
    """The fastest plan whose every worker fits in ``memory_limit`` bytes (None: no limit).

    ``topology`` (a :class:`Topology` or a string such as ``"4x16GB/s,4x10Gbit/s"``) gives
    the workers and links; without it ``workers`` workers share infinitely fast links.
    With ``batch_size`` each step processes that many samples split into micro-batches
    (the profile is rescaled to each micro-batch size); without it a micro-batch is the
    profile's and the step grows with the micro-batch count. Candidates: PipeDream's
    replicated pipeline (unless ``replication`` is False), a straight pipeline with one
    stage per worker, and for the schedules with chunks a pipeline of two per worker; each
    with every requested schedule that can run it, every micro-batch count, and the
    cheapest recomputation mode that fits. Recomputation adds one forward of the stage to
    its backward (for ``except_last``, on all micro-batches but the last). The fastest by
    simulated throughput wins; the plan's ``rejected`` says why each other schedule lost.
    ``progress``, if given, receives a line as each part of the work starts (the layouts for
    each micro-batch count, each simulated candidate). With ``every_worker``, only layouts
    that give every worker work are considered (a job of that many processes needs them);
    otherwise a replicated layout may leave workers idle when that is as fast.
    ``shared_cores``: the workers all share this many cores (local workers, or an emulated
    cluster on one machine), so compute stretches when more of them are busy at once (see
    :mod:`pipetrain.planning.sharing`); ``None``: each worker has its own.
    """
    if shared_cores is not None and (
        isinstance(shared_cores, bool) or not isinstance(shared_cores, int) or shared_cores < 1
    ):
        raise ValueError(f"shared_cores must be a positive integer or None, got {shared_cores!r}")
    if not isinstance(profile, Profile):
        raise TypeError(f"profile must be a pipetrain.Profile, got {type(profile).__name__}")
    if len(profile) > MAX_LAYERS:
        raise ValueError(
            f"the profile has {len(profile):,} layers, more than the {MAX_LAYERS:,} the planner "
            "takes (its partitioning costs time and memory with the square of the layer "
            "count); profile the model in coarser layers, such as its blocks"
        )
    topology = resolve(topology, workers)
    schedules = _checked_schedules(schedules)
    counts = _microbatch_counts(microbatches, batch_size)
    if memory_limit is not None and not memory_limit > 0:
        raise ValueError(
            f"memory_limit must be a positive number of bytes per worker, got {memory_limit!r}"
        )
    report = progress or _silent
    verdicts = Verdicts(schedules)
    fitting, smallest = fitting_candidates(
        profile,
        topology,
        schedules,
        counts,
        batch_size,
        replication,
        memory_limit,
        report,
        verdicts,
        every_worker,
    )
    if not fitting:
        raise ValueError(_no_fit_message(memory_limit, smallest, profile, topology, replication))
    chosen = _fastest(fitting, topology, report, verdicts, shared_cores)
    chosen.rejected = verdicts.rejected(chosen.schedule, memory_limit)
    return chosen


def _silent(message: str) -> None:
    """Progress nobody asked for."""


def _checked_schedules(schedules: Sequence[str] | None) -> tuple[str, ...]:
    """The requested schedule names, validated."""
    if isinstance(schedules, str):
        schedules = (schedules,)
    if schedules is None:
        return tuple(name for name in names() if spec(name).planned_by_default)
    unknown = [name for name in schedules if name not in names()]
    if unknown or not schedules:
        raise ValueError(
            f"schedules {list(schedules)!r} must be a non-empty choice of {', '.join(names())}"
        )
    return tuple(schedules)


def _microbatch_counts(microbatches: Sequence[int], batch_size: int | None) -> list[int]:
    """Micro-batch counts to try: the requested ones (that divide ``batch_size`` if given)."""
    if isinstance(microbatches, int):
        microbatches = (microbatches,)
    if not microbatches or any(
        isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in microbatches
    ):
        raise ValueError(f"microbatches must be positive integers, got {microbatches!r}")
    if batch_size is None:
        return sorted(set(microbatches))
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    counts = sorted(m for m in set(microbatches) if batch_size % m == 0)
    if not counts:
        raise ValueError(
            f"none of the micro-batch counts {sorted(set(microbatches))} divides "
            f"batch_size={batch_size}; give counts that divide it"
        )
    return counts


def _fastest(
    fitting: list[tuple[Candidate, list[float]]],
    topology: Topology,
    report: Callable[[str], None],
    verdicts: Verdicts,
    cores: int | None,
) -> Plan:
    """Simulate candidates, most promising first, until none can beat the best so far
    (telling ``verdicts`` each candidate's bound and simulated throughput); the workers
    share ``cores`` cores (None: one each).

    A candidate's promise is its throughput at its makespan lower bound. Of the candidates
    within :data:`FEWER_WITHIN` of the fastest, the one with the fewest stages wins, then
    the fewest micro-batches, then the faster, then the one on fewer workers, then the one
    with the smaller peak memory.
    """
    report(f"planning: {counted(len(fitting), 'candidate')} fit; simulating the most promising")
    bounded = []
    for candidate, memory in fitting:
        costs = candidate.costs(topology)
        family = spec(candidate.schedule)
        played = family.window(candidate.microbatches, family.resolve({}))  # 2bw: 2 updates
        ceiling = (
            played * candidate.profile.microbatch_size / max(candidate.lower_bound(costs), 1e-300)
        )
        verdicts.bounded(candidate, ceiling)
        bounded.append((ceiling, max(memory), candidate, memory, costs))
    bounded.sort(key=lambda entry: (-entry[0], entry[1]))
    results: list[_Simulated] = []
    fastest = 0.0
    best: _Simulated | None = None
    for simulated, (ceiling, peak, candidate, memory, costs) in enumerate(bounded):
        if ceiling < fastest * (1 - FEWER_WITHIN):
            report(f"planning: the other {len(bounded) - simulated} cannot beat it")
            break
        # a bound from unstretched costs stays a bound: sharing cores only slows a step
        timeline, processed, costs = candidate.build_and_simulate(costs, cores)
        size = candidate.profile.microbatch_size
        throughput = processed * size / timeline.makespan if timeline.makespan > 0 else math.inf
        verdicts.simulated(candidate, throughput)
        fastest = max(fastest, throughput)
        results.append(
            _Simulated(throughput, peak, candidate, memory, costs, processed, timeline.makespan)
        )
        best = _chosen(results, fastest)
        report(
            f"planning: {simulated + 1}/{len(bounded)} candidates simulated, best so far "
            f"{_summary(best.candidate)}: {best.throughput:.4g} samples/s steady"
        )
    assert best is not None  # the first candidate is always simulated
    verdicts.chose(best.throughput)
    _, _, candidate, memory, costs, processed, makespan = best
    variation = candidate.variation()
    if variation is not None:
        report("planning: simulating the chosen plan's steps with the measured variation")
    step_s = makespan if variation is None else _varied_step_s(candidate, costs, variation)
    plan = _as_plan(candidate, memory, step_s, makespan, processed, costs)
    plan.topology = str(topology)
    return plan


def _summary(candidate: Candidate) -> str:
    """``"1f1b, 8 stages on 64 ranks, 16 micro-batches"``."""
    layout = candidate.layout
    return (
        f"{candidate.schedule}, {counted(len(layout.stages), 'stage')} on "
        f"{counted(layout.workers, 'rank')}, "
        f"{counted(candidate.microbatches, 'micro-batch', 'micro-batches')}"
    )


def _varied_step_s(candidate: Candidate, costs: Costs, variation: Variation) -> float:
    """The median makespan of the candidate's steps simulated under ``variation``: as many
    as :data:`VARIED_RUNS` allows, fewer for long schedules: their makespan, a sum over many
    actions, varies less from one simulated step to the next, and each step costs more."""
    schedule = candidate.build()
    actions = sum(len(lane) for lane in schedule.ranks)
    fewest, most = VARIED_RUNS
    return median_makespan(
        schedule, costs, variation, max(fewest, min(most, _VARIED_ACTIONS // max(actions, 1)))
    )


class _Simulated(NamedTuple):
    """A simulated candidate: its throughput, peak memory and what its plan is made from."""

    throughput: float
    peak: float
    candidate: Candidate
    memory: list[float]
    costs: Costs
    processed: int
    makespan: float


def _chosen(results: list[_Simulated], fastest: float) -> _Simulated:
    """Of ``results`` within :data:`FEWER_WITHIN` of ``fastest``, the one with the fewest
    stages (model chunks), then the fewest micro-batches, then the fastest (within a
    relative 1e-9), then the one on the fewest workers (a replica whose all-reduce hides
    behind other work costs nothing in the simulation), then the smallest peak memory."""
    near = [r for r in results if r.throughput >= fastest * (1 - FEWER_WITHIN)]
    for count in (lambda r: len(r.candidate.layout.stages), lambda r: r.candidate.microbatches):
        fewest = min(count(r) for r in near)
        near = [r for r in near if count(r) == fewest]
    quickest = max(r.throughput for r in near)
    return min(
        (r for r in near if r.throughput >= quickest * (1 - 1e-9)),
        key=lambda r: (r.candidate.layout.workers, r.peak),
    )


def _as_plan(
    candidate: Candidate,
    memory: list[float],
    step_s: float,
    steady_step_s: float,
    processed: int,
    costs: Costs,
) -> Plan:
    """The public record of a simulated candidate that steps in ``step_s`` (``steady_step_s``
    with every action at its median) and processes ``processed`` micro-batches a step."""
    layout = candidate.layout
    size = candidate.profile.microbatch_size
    count = len(layout.stages)
    forward = costs.per_stage("forward_s", count)
    backward = costs.per_stage("backward_s", count)
    weight = costs.per_stage("weight_s", count)
    return Plan(
        stages=[PlanStage(start, stop, replicas) for start, stop, replicas in layout.stages],
        schedule=candidate.schedule,
        microbatches=candidate.microbatches,
        recompute=candidate.recompute,
        predicted_step_s=step_s,
        predicted_throughput=processed * size / step_s if step_s > 0 else math.inf,
        steady_step_s=steady_step_s,
        stage_memory_bytes=memory,
        ranks=layout.workers,
        microbatch_size=size,
        virtual=layout.virtual,
        stage_compute_s=[f + b + w for f, b, w in zip(forward, backward, weight)],
        model=candidate.profile.model,
    )


def _no_fit_message(
    memory_limit: float | None,
    smallest: tuple[float, Candidate | None],
    profile: Profile,
    topology: Topology,
    replication: bool,
) -> str:
    """Why nothing was chosen, and which knobs would help."""
    need, candidate = smallest
    if candidate is None:
        reason = (
            "replication=False needs at least one layer per rank"
            if not replication
            else "no schedule can run it"
        )
        return (
            f"no candidate plan for {len(profile.layers)} layers on "
            f"{counted(topology.workers, 'rank')}: {reason}; use fewer ranks, replication=True, "
            "or other schedules"
        )
    return (
        f"no candidate plan fits a memory limit of {format_bytes(memory_limit or 0.0)} a rank "
        f"(memory_limit, pipetrain plan --memory); the smallest needs {math.ceil(need)} bytes "
        f"({format_bytes(need)}: {candidate.schedule}, "
        f"{counted(candidate.microbatches, 'micro-batch', 'micro-batches')}, recomputation "
        f"{candidate.recompute}, the cheapest that fits it). Raise the limit to at least that, "
        "or make each rank hold less: more micro-batches for the same batch size (smaller "
        "micro-batches hold less activation memory), or more ranks (fewer layers and weights "
        "each)."
    )
