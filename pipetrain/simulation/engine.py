"""Play a schedule against costs and produce a predicted :class:`~pipetrain.timeline.Timeline`.

Every rank runs its actions in order. Compute takes the stage's cost; a send starts a
transfer on the directed link to its peer (links carry one transfer at a time, in the
order the sender issues them) and does not block the sender; a receive waits until its
transfer has arrived; an all-reduce starts when every replica of the stage has reached it.
"""

from __future__ import annotations

import random
import statistics
from collections import defaultdict, deque

from pipetrain.schedules import Kind, Schedule
from pipetrain.simulation.costs import Costs, Variation
from pipetrain.timeline import Event, Timeline


def simulate(
    schedule: Schedule, costs: Costs, variation: Variation | None = None, seed: int = 0
) -> Timeline:
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
            raise ValueError(
                f"Costs.{name} must be a non-negative number of seconds, got {getattr(costs, name)!r}"
            )
    duration = {
        Kind.FORWARD: forward,
        Kind.BACKWARD: backward
        if schedule.split_backward
        else [b + w for b, w in zip(backward, weight)],
        Kind.WEIGHT: weight,
        Kind.STEP: step,
    }

    if variation is not None:
        variation.check(stages)
        draw = random.Random(seed).choice
        factors = {
            Kind.FORWARD: variation.forward,
            Kind.BACKWARD: variation.backward,
            Kind.WEIGHT: variation.backward,
        }

    def transfer_s(boundary: int) -> float:
        return costs.latency_s + activation[boundary] / bandwidth[boundary]

    clock = [0.0] * schedule.num_ranks
    position = [0] * schedule.num_ranks
    events: list[Event] = []
    arrival: dict[
        tuple[int, Kind, int, int], float
    ] = {}  # (receiver, recv kind, stage, mb) -> time
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
                key = (
                    action.peer,
                    Kind.RECV_F if kind is Kind.SEND_F else Kind.RECV_B,
                    stage + 1 if kind is Kind.SEND_F else stage - 1,
                    mb,
                )
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
        raise RuntimeError(
            f"simulation of {schedule.name} stopped with ranks {unfinished} waiting; validate the schedule first"
        )
    return Timeline(events, schedule.num_ranks, label=schedule.name)


def median_makespan(
    schedule: Schedule, costs: Costs, variation: Variation, runs: int = 64, seed: int = 0
) -> float:
    """The median makespan of ``runs`` simulated steps under ``variation`` (seeds ``seed``,
    ``seed + 1``, ...).

    A step waits for its slowest path, so its typical length exceeds the step of median
    actions: slow actions add up along the path, and a slow stage holds up those after it.
    """
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise ValueError(f"runs must be a positive integer, got {runs!r}")
    return statistics.median(
        simulate(schedule, costs, variation, seed + run).makespan for run in range(runs)
    )
