"""Which fitting candidate the planner chooses: simulated most promising first, the fewest
stages, then the fewest micro-batches, among those within :data:`FEWER_WITHIN` of the
fastest.

Simulating a candidate (building its schedule, then playing it) is the planner's dearest
step: about a fifth of a second for a V schedule on 64 ranks. Two bounds on each
candidate's throughput decide which need it. Every candidate has the stage-sum bound
(:meth:`~pipetrain.planning.candidates.Candidate.lower_bound`), and they are taken in its
order; one it cannot rule out is first given the tighter written bound
(:meth:`~pipetrain.planning.candidates.Candidate.written_bound`, which plays its written
passes and their messages, a sixth of the simulation's time) and put back in line. A
candidate is simulated only when it is still the most promising. Any whose bound falls more
than :data:`FEWER_WITHIN` below the fastest so far cannot be near the fastest; one whose bound is
below a simulated candidate's throughput, with no fewer stages and micro-batches than it,
cannot win either: so neither is simulated, and the choice is the one that simulating every
candidate the stage-sum bound leaves in would make (``exhaustive``, which the tests
compare).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import NamedTuple

from pipetrain.planning.candidates import Candidate
from pipetrain.planning.result import Plan, PlanStage
from pipetrain.planning.topology import Topology
from pipetrain.planning.verdicts import Verdicts
from pipetrain.schedules import Schedule, spec
from pipetrain.simulation import Costs, Variation, median_makespan
from pipetrain.units import counted

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

_TIED = 1e-9
"""Throughputs within this fraction of each other are level."""


class _Entry(NamedTuple):
    """A fitting candidate, its memory, costs, and its peak (the order's tie-break)."""

    candidate: Candidate
    memory: list[float]
    costs: Costs
    peak: float


class _Simulated(NamedTuple):
    """A simulated candidate: its throughput, place in line, and what its plan is made from."""

    throughput: float
    place: int
    entry: _Entry
    schedule: Schedule
    costs: Costs
    processed: int
    makespan: float


def fastest(
    fitting: list[tuple[Candidate, list[float]]],
    topology: Topology,
    report: Callable[[str], None],
    verdicts: Verdicts,
    cores: int | None,
    exhaustive: bool = False,
) -> Plan:
    """The plan chosen among ``fitting`` (see the module docstring), telling ``verdicts``
    each candidate's bound and simulated throughput; the workers share ``cores`` cores
    (None: one each). ``exhaustive`` simulates every candidate the stage-sum bound cannot
    rule out (the same choice, slower).

    Of the candidates within :data:`FEWER_WITHIN` of the fastest, the one with the fewest
    stages wins, then the fewest micro-batches, then the faster, then the one on fewer
    workers, then whole copies before shards and a worker's own weights before a host
    store's, then the one with the smaller peak memory, then the one first in line.
    """
    report(f"planning: {counted(len(fitting), 'candidate')} fit; simulating the most promising")
    line: list[tuple[float, _Entry]] = []
    for candidate, memory in fitting:
        costs = candidate.costs(topology)
        ceiling = _throughput(candidate, candidate.lower_bound(costs))
        line.append((ceiling, _Entry(candidate, memory, costs, max(memory))))
        verdicts.bounded(candidate, ceiling)
    line.sort(key=lambda pair: (-pair[0], pair[1].peak))
    results, ruled_out = _simulated(line, report, verdicts, cores, exhaustive)
    for place, ceiling in ruled_out.items():
        verdicts.ruled_out(line[place][1].candidate, ceiling)
    best = _chosen(results, max(r.throughput for r in results))
    verdicts.chose(best.throughput)
    candidate = best.entry.candidate
    variation = candidate.variation()
    if variation is not None:
        report("planning: simulating the chosen plan's steps with the measured variation")
    step_s = (
        best.makespan if variation is None else _varied_step_s(best.schedule, best.costs, variation)
    )
    plan = _as_plan(candidate, best.entry.memory, step_s, best.makespan, best.processed, best.costs)
    plan.topology = str(topology)
    return plan


def _simulated(
    line: list[tuple[float, _Entry]],
    report: Callable[[str], None],
    verdicts: Verdicts,
    cores: int | None,
    exhaustive: bool,
) -> tuple[list[_Simulated], dict[int, float]]:
    """The candidates simulated, taking ``line`` (stage-sum ceilings, highest first) by its
    best known bounds as the module docstring says; and by place in line, the ceiling of
    each candidate that a written bound or a faster candidate ruled out."""
    ceilings = [ceiling for ceiling, _ in line]
    # (-ceiling, place in line, whether the ceiling is the written bound's)
    waiting = [(-ceiling, place, exhaustive) for place, ceiling in enumerate(ceilings)]
    results: list[_Simulated] = []
    ruled_out: dict[int, float] = {}
    fastest = 0.0
    outdone = 0
    while waiting:
        ceiling, place, tightened = heapq.heappop(waiting)
        ceiling = -ceiling
        if ceiling < fastest * (1 - FEWER_WITHIN):
            waiting.append((-ceiling, place, tightened))
            break
        entry = line[place][1]
        if not exhaustive and _outdone(entry.candidate, ceiling, results):
            ruled_out[place] = ceiling
            outdone += 1
            continue
        if not tightened:
            bound = entry.candidate.written_bound(entry.costs)
            if bound is not None:  # less a rounding's worth: it can equal the simulated step
                slack = _throughput(entry.candidate, bound * (1 - _TIED))
                ruled_out[place] = ceilings[place] = min(ceiling, slack)
            heapq.heappush(waiting, (-ceilings[place], place, True))
            continue
        ruled_out.pop(place, None)
        schedule = entry.candidate.build()
        timeline, processed, costs = entry.candidate.simulate(schedule, entry.costs, cores)
        size = entry.candidate.profile.microbatch_size
        makespan = timeline.makespan
        throughput = processed * size / makespan if makespan > 0 else math.inf
        verdicts.simulated(entry.candidate, throughput)
        fastest = max(fastest, throughput)
        results.append(_Simulated(throughput, place, entry, schedule, costs, processed, makespan))
        best = _chosen(results, fastest)
        report(
            f"planning: {len(results)}/{len(line)} candidates simulated, best so far "
            f"{_summary(best.entry.candidate)}: {best.throughput:.4g} samples/s steady"
        )
    if waiting or outdone:
        report(f"planning: the other {len(waiting) + outdone} cannot beat it")
    return results, ruled_out


def _throughput(candidate: Candidate, makespan: float) -> float:
    """Samples a second at ``makespan`` a step: every micro-batch the step plays (two
    updates' worth for ``2bw``)."""
    family = spec(candidate.schedule)
    played = family.window(candidate.microbatches, family.resolve({}))
    return played * candidate.profile.microbatch_size / max(makespan, 1e-300)


def _outdone(candidate: Candidate, ceiling: float, results: list[_Simulated]) -> bool:
    """Whether a simulated candidate rules ``candidate`` out: one faster than ``ceiling``
    (beyond a tie) with no more stages, and no more micro-batches where the stages are
    as many. If that one ends within :data:`FEWER_WITHIN` of the fastest, it beats
    ``candidate`` on stages, micro-batches or speed; if not, neither does ``candidate``."""
    stages = len(candidate.layout.stages)
    return any(
        r.throughput * (1 - _TIED) > ceiling
        and (len(r.entry.candidate.layout.stages), r.entry.candidate.microbatches)
        <= (stages, candidate.microbatches)
        for r in results
    )


def _summary(candidate: Candidate) -> str:
    """``"1f1b, 8 stages on 64 ranks, 16 micro-batches"`` (``sharded`` after the ranks
    where the replicas hold shards)."""
    layout = candidate.layout
    sharded = " sharded" if layout.shard else ""
    return (
        f"{candidate.schedule}, {counted(len(layout.stages), 'stage')} on "
        f"{counted(layout.workers, 'rank')}{sharded}, "
        f"{counted(candidate.microbatches, 'micro-batch', 'micro-batches')}"
    )


def _varied_step_s(schedule: Schedule, costs: Costs, variation: Variation) -> float:
    """The median makespan of ``schedule``'s steps simulated under ``variation``: as many
    as :data:`VARIED_RUNS` allows, fewer for long schedules: their makespan, a sum over many
    actions, varies less from one simulated step to the next, and each step costs more."""
    actions = sum(len(lane) for lane in schedule.ranks)
    fewest, most = VARIED_RUNS
    return median_makespan(
        schedule, costs, variation, max(fewest, min(most, _VARIED_ACTIONS // max(actions, 1)))
    )


def _chosen(results: list[_Simulated], fastest: float) -> _Simulated:
    """Of ``results`` within :data:`FEWER_WITHIN` of ``fastest``, the one with the fewest
    stages (model chunks), then the fewest micro-batches, then the fastest (within
    :data:`_TIED`), then the one on the fewest workers (a replica whose all-reduce hides
    behind other work costs nothing in the simulation), then whole copies and then own
    weights (before shards and a host store), then the smallest peak memory, then the first
    in line."""
    near = [r for r in results if r.throughput >= fastest * (1 - FEWER_WITHIN)]
    for count in (
        lambda r: len(r.entry.candidate.layout.stages),
        lambda r: r.entry.candidate.microbatches,
    ):
        fewest = min(count(r) for r in near)
        near = [r for r in near if count(r) == fewest]
    quickest = max(r.throughput for r in near)
    return min(
        (r for r in near if r.throughput >= quickest * (1 - _TIED)),
        # whole copies before shards, own weights before a host store's: gathering and the
        # host's loads cost copies the model leaves out
        key=lambda r: (
            r.entry.candidate.layout.workers,
            r.entry.candidate.layout.shard,
            r.entry.candidate.layout.host_link is not None,
            r.entry.peak,
            r.place,
        ),
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
        shard=layout.shard,
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
