"""Play a schedule against costs and produce a predicted :class:`~pipetrain.trace.Timeline`.

Every rank runs its actions in order. Compute takes the stage's cost; a send starts a
transfer on the directed link to its peer (links carry one transfer at a time, in the
order the sender issues them) and does not block the sender; a receive waits until its
transfer has arrived; an all-reduce starts when every replica of the stage has reached it.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from pipetrain.schedules import Kind, Schedule
from pipetrain.trace import Event, Timeline

PerStage = float | Sequence[float]


@dataclass(frozen=True)
class Costs:
    """Times in seconds per micro-batch and a communication model.

    ``forward_s``, ``backward_s`` (the input-gradient part), ``weight_s`` (the
    weight-gradient part; an unsplit backward costs ``backward_s + weight_s``), ``step_s``
    (optimizer step) and ``allreduce_s`` (a replicated stage's gradient all-reduce) are a
    float for every stage or one value per stage. ``activation_bytes`` and ``bandwidth``
    (bytes/s) are a float or one value per stage boundary (boundary s joins stage s and
    s + 1); a transfer costs ``latency_s + bytes / bandwidth``, and gradients are as large
    as the activations they belong to. ``receive_s`` is the time a receive keeps the
    receiving rank busy once the data is there (copying it in), as on CPU backends.
    """

    forward_s: PerStage
    backward_s: PerStage
    weight_s: PerStage = 0.0
    activation_bytes: PerStage = 0.0
    bandwidth: PerStage = math.inf
    latency_s: float = 0.0
    step_s: PerStage = 0.0
    allreduce_s: PerStage = 0.0
    receive_s: float = 0.0

    def per_stage(self, field: str, count: int) -> list[float]:
        """The named field expanded to ``count`` values, checked for length and sign."""
        value = getattr(self, field)
        values = [float(value)] * count if isinstance(value, (int, float)) else [float(v) for v in value]
        if len(values) != count:
            raise ValueError(f"Costs.{field} has {len(values)} values, expected {count} (or one float)")
        if any(v < 0 or math.isnan(v) for v in values):
            raise ValueError(f"Costs.{field} must be non-negative, got {values}")
        return values


@dataclass(frozen=True)
class Variation:
    """How much a stage's actions vary from run to run, as measured.

    ``forward[s]`` and ``backward[s]`` are factors by which stage ``s``'s forward and
    backward (with its weight-gradient part) took longer, in measured runs, than their
    cost in :class:`Costs`. Each compute action draws one factor of its kind at random.
    """

    forward: Sequence[Sequence[float]]
    backward: Sequence[Sequence[float]]

    def check(self, stages: int) -> None:
        """Raise unless both kinds have a non-empty list of non-negative factors per stage."""
        for name in ("forward", "backward"):
            factors = getattr(self, name)
            if len(factors) != stages or any(not values or min(values) < 0 for values in factors):
                raise ValueError(f"Variation.{name} needs a non-empty list of non-negative factors for each of the {stages} stages")


def simulate(schedule: Schedule, costs: Costs, variation: Variation | None = None, seed: int = 0) -> Timeline:
    """Execute ``schedule`` on ``costs`` and return the predicted timeline.

    With ``variation``, every forward, backward and weight-gradient action is its cost times
    a factor drawn from the variation (random, repeatable for one ``seed``): one possible
    step of a pipeline whose actions vary as measured.
    """
    stages = schedule.stages
    forward = costs.per_stage("forward_s", stages)
    backward = costs.per_stage("backward_s", stages)
    weight = costs.per_stage("weight_s", stages)
    step = costs.per_stage("step_s", stages)
    allreduce = costs.per_stage("allreduce_s", stages)
    boundaries = max(stages - 1, 1)
    activation = costs.per_stage("activation_bytes", boundaries)
    bandwidth = costs.per_stage("bandwidth", boundaries)
    if any(b == 0 for b in bandwidth):
        raise ValueError("Costs.bandwidth must be positive")
    for name in ("latency_s", "receive_s"):
        if not getattr(costs, name) >= 0:
            raise ValueError(f"Costs.{name} must be a non-negative number of seconds, got {getattr(costs, name)!r}")
    duration = {
        Kind.FORWARD: forward,
        Kind.BACKWARD: backward if schedule.split_backward else [b + w for b, w in zip(backward, weight)],
        Kind.WEIGHT: weight,
        Kind.STEP: step,
    }

    if variation is not None:
        variation.check(stages)
        draw = random.Random(seed).choice
        factors = {Kind.FORWARD: variation.forward, Kind.BACKWARD: variation.backward, Kind.WEIGHT: variation.backward}

    def transfer_s(boundary: int) -> float:
        return costs.latency_s + activation[boundary] / bandwidth[boundary]

    clock = [0.0] * schedule.num_ranks
    position = [0] * schedule.num_ranks
    events: list[Event] = []
    arrival: dict[tuple[int, Kind, int, int], float] = {}  # (receiver, recv kind, stage, mb) -> time
    link_free: dict[tuple[int, int], float] = defaultdict(float)
    waiting_on: dict[tuple[int, Kind, int, int], int] = {}
    allreduce_arrived: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)
    allreduce_done: list[dict[int, int]] = [defaultdict(int) for _ in range(schedule.num_ranks)]
    runnable = deque(range(schedule.num_ranks))

    def record(rank: int, kind: Kind, stage: int, mb: int | None, start: float, end: float) -> None:
        events.append(Event(rank, kind.value, stage, mb, start, end))

    while runnable:
        rank = runnable.popleft()
        actions = schedule.ranks[rank]
        while position[rank] < len(actions):
            action = actions[position[rank]]
            kind, stage, mb = action.kind, action.stage, action.microbatch
            now = clock[rank]
            if kind in duration:
                cost = duration[kind][stage]
                if variation is not None and kind in factors:
                    cost *= draw(factors[kind][stage])
                end = now + cost
                record(rank, kind, stage, mb, now, end)
                clock[rank] = end
            elif kind in (Kind.SEND_F, Kind.SEND_B):
                boundary = stage if kind is Kind.SEND_F else stage - 1
                link = (rank, action.peer)
                start = max(now, link_free[link])
                end = start + transfer_s(boundary)
                link_free[link] = end
                record(rank, kind, stage, mb, start, end)
                key = (action.peer, Kind.RECV_F if kind is Kind.SEND_F else Kind.RECV_B, stage + 1 if kind is Kind.SEND_F else stage - 1, mb)
                arrival[key] = end
                if key in waiting_on:
                    runnable.append(waiting_on.pop(key))
            elif kind in (Kind.RECV_F, Kind.RECV_B):
                key = (rank, kind, stage, mb)
                if key not in arrival:
                    waiting_on[key] = rank
                    break
                end = max(now, arrival.pop(key)) + costs.receive_s
                record(rank, kind, stage, mb, now, end)
                clock[rank] = end
            elif kind is Kind.ALLREDUCE:
                group = schedule.stage_ranks[stage]
                key = (stage, allreduce_done[rank][stage])
                allreduce_arrived[key][rank] = now
                if len(allreduce_arrived[key]) < len(group):
                    break
                start = max(allreduce_arrived[key].values())
                for member in group:
                    record(member, kind, stage, None, start, start + allreduce[stage])
                    clock[member] = start + allreduce[stage]
                    allreduce_done[member][stage] += 1
                    position[member] += 1
                    if member != rank:
                        runnable.append(member)
                continue
            position[rank] += 1
    unfinished = [r for r in range(schedule.num_ranks) if position[r] < len(schedule.ranks[r])]
    if unfinished:
        raise RuntimeError(f"simulation of {schedule.name} stopped with ranks {unfinished} waiting; validate the schedule first")
    return Timeline(events, schedule.num_ranks, label=schedule.name)


def median_makespan(schedule: Schedule, costs: Costs, variation: Variation, runs: int = 64, seed: int = 0) -> float:
    """The median makespan of ``runs`` simulated steps under ``variation`` (seeds ``seed``,
    ``seed + 1``, ...).

    A step waits for its slowest path, so its typical length exceeds the step of median
    actions: slow actions add up along the path, and a slow stage holds up those after it.
    """
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise ValueError(f"runs must be a positive integer, got {runs!r}")
    return statistics.median(simulate(schedule, costs, variation, seed + run).makespan for run in range(runs))


def measured_costs(timelines: Timeline | Sequence[Timeline], stages: int) -> Costs:
    """Simulator costs from measured timelines: per stage, the median F, B, W and STEP durations.

    A send's time on the sending rank (packing the message) is added to the compute it
    follows. A measured receive is waiting plus copying the data in; the shortest receive
    (one whose data was already there) gives ``receive_s``. The transfer time is
    :func:`transfer_time`. Several timelines (steps) may be given: medians are then over
    all of them, which steadies noisy measurements.
    """
    runs = [timelines] if isinstance(timelines, Timeline) else list(timelines)

    def per_stage(kind: str, statistic) -> list[float]:
        durations: list[list[float]] = [[] for _ in range(stages)]
        for timeline in runs:
            for event in timeline.events:
                if event.kind == kind and event.stage is not None:
                    durations[event.stage].append(event.duration)
        return [statistic(values) if values else 0.0 for values in durations]

    def total(*parts: list[float]) -> list[float]:
        return [sum(values) for values in zip(*parts)]

    median = statistics.median
    return Costs(
        forward_s=total(per_stage("F", median), per_stage("SEND_F", median)),
        backward_s=total(per_stage("B", median), per_stage("SEND_B", median)),
        weight_s=per_stage("W", median),
        step_s=per_stage("STEP", median),
        allreduce_s=per_stage("ALLREDUCE", median),
        receive_s=min((e.duration for t in runs for e in t.events if e.kind in ("RECV_F", "RECV_B")), default=0.0),
        latency_s=statistics.median(transfer_time(timeline) for timeline in runs) if runs else 0.0,
    )


def transfer_time(timeline: Timeline) -> float:
    """Median time a message spends between the end of its send and the end of its receive.

    Only the part of the receive that follows the send counts, so a receiver that arrives
    late (the data already there) adds only its own copy time. 0 without transfers.
    """
    sends = {(e.kind, e.stage, e.microbatch): e for e in timeline.events if e.kind in ("SEND_F", "SEND_B")}
    senders = {"RECV_F": ("SEND_F", -1), "RECV_B": ("SEND_B", +1)}  # receive kind -> send kind, stage offset
    gaps = []
    for event in timeline.events:
        if event.kind not in senders or event.stage is None:
            continue
        kind, offset = senders[event.kind]
        send = sends.get((kind, event.stage + offset, event.microbatch))
        if send is not None:
            gaps.append(max(0.0, event.end - max(send.end, event.start)))
    return statistics.median(gaps) if gaps else 0.0
