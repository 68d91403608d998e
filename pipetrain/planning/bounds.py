"""A step no simulation of a schedule can beat, from its written passes alone.

:meth:`pipetrain.planning.candidates.Candidate.lower_bound` reads only per-stage sums, so it
cannot see a schedule's own bubbles (a V order held under a small cap, a pipeline's fill on
many ranks). :func:`written_bound` plays the schedule's written passes in their order
without lowering, validating or simulating it: each pass starts once its rank's previous
pass has ended and, where it takes another rank's output, once that output could have
arrived (the send's and receive's busy times, the bytes on the link alone, the latency).
Every one of those is a delay the simulator charges at least, so its step is never shorter;
the planner uses the bound to skip simulating candidates that cannot win.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

from pipetrain.allocation import collector_paused
from pipetrain.schedules import Action, Kind, spec
from pipetrain.simulation import Costs


def written_bound(
    schedule: str,
    ranks: int,
    microbatches: int,
    replicas: Sequence[int] | None,
    options: dict[str, int | bool],
    costs: Costs,
) -> float | None:
    """A makespan that simulating ``schedule`` (built with these arguments, as
    :func:`pipetrain.schedules.build` takes them) on ``costs`` cannot beat; ``None`` where
    the schedule overlaps passes or its costs scale micro-batches apart (the simulator
    prices those in ways this bound leaves out)."""
    if costs.compute_scale or costs.bytes_scale:
        return None
    family = spec(schedule)
    with collector_paused():  # many small objects, none of them cyclic
        orders, stage_ranks, _ = family.generate(
            ranks, microbatches, replicas, family.resolve(options)
        )
    stages = len(stage_ranks)
    forward, backward, weight, step, allreduce = (
        costs.per_stage(name, stages)
        for name in ("forward_s", "backward_s", "weight_s", "step_s", "allreduce_s")
    )
    duration = {
        Kind.FORWARD: forward,
        Kind.BACKWARD: backward
        if family.split_backward
        else [b + w for b, w in zip(backward, weight)],
        Kind.WEIGHT: weight,
        Kind.STEP: step,
        Kind.ALLREDUCE: allreduce,  # a collective ends no sooner than its own rank's share
        # a host store's loads and returns take the rank's link to it, not its compute
        Kind.LOAD: [0.0] * stages,
        Kind.OFFLOAD: [0.0] * stages,
    }
    boundaries = max(stages - 1, 1)
    sizes = costs.per_stage("activation_bytes", boundaries)
    speeds = costs.per_stage("bandwidth", boundaries)
    # the least a message across each boundary adds between its producer and consumer
    transfer = [
        costs.send_busy_s(size) + size / speed + costs.latency_s + costs.receive_busy_s(size)
        for size, speed in zip(sizes, speeds)
    ]
    try:
        with collector_paused():
            played = _played(orders, stage_ranks, duration, transfer)
    except (IndexError, KeyError, TypeError):
        return None  # a generator's mistake, which building the schedule reports
    return None if played is None else played + costs.loss_s


def _into(
    stage_ranks: Sequence[Sequence[int]], transfer: list[float], offset: int
) -> list[tuple[float, ...]]:
    """Per stage, what its passes' input from stage ``stage + offset`` adds on the way, by
    micro-batch (round-robin over both stages' replicas): a transfer where the two passes
    run on different ranks."""
    into: list[tuple[float, ...]] = []
    for stage, consumers in enumerate(stage_ranks):
        source = stage + offset
        if not 0 <= source < len(stage_ranks):
            into.append((0.0,))
            continue
        producers = stage_ranks[source]
        cycle = math.lcm(len(producers), len(consumers))
        into.append(
            tuple(
                transfer[min(stage, source)]
                if producers[k % len(producers)] != consumers[k % len(consumers)]
                else 0.0
                for k in range(cycle)
            )
        )
    return into


def _played(
    orders: Sequence[Sequence[Action]],
    stage_ranks: Sequence[Sequence[int]],
    duration: dict[Kind, list[float]],
    transfer: list[float],
) -> float | None:
    """The last end of :func:`written_bound`'s play, without the loss all-reduce. A rank
    plays until its next pass's input is missing; the pass that provides it puts the rank
    back to work."""
    forward_kind, backward_kind = Kind.FORWARD, Kind.BACKWARD
    forward, backward = duration[forward_kind], duration[backward_kind]
    into_forward, into_backward = _into(stage_ranks, transfer, -1), _into(stage_ranks, transfer, 1)
    stages, last = len(stage_ranks), len(stage_ranks) - 1
    # each forward's and backward's end, at 2·(micro-batch · stages + stage), + 1 for a
    # backward: a forward takes the forward before it (key - 2), a backward the one after
    ended: dict[int, float] = {}
    waiting: dict[int, int] = {}  # the rank waiting for each of them
    position, clock = [0] * len(orders), [0.0] * len(orders)
    work = list(range(len(orders)))
    while work:
        rank = work.pop()
        order, index, now = orders[rank], position[rank], clock[rank]
        while index < len(order):
            kind, stage, mb, _, _ = order[index]
            if kind is forward_kind:
                key = (cast(int, mb) * stages + stage) << 1
                if stage:
                    ready = ended.get(key - 2)
                    if ready is None:
                        waiting[key - 2] = rank
                        break
                    delays = into_forward[stage]
                    ready += delays[cast(int, mb) % len(delays)]
                    if ready > now:
                        now = ready
                now += forward[stage]
            elif kind is backward_kind:
                key = ((cast(int, mb) * stages + stage) << 1) | 1
                if stage < last:
                    ready = ended.get(key + 2)
                    if ready is None:
                        waiting[key + 2] = rank
                        break
                    delays = into_backward[stage]
                    ready += delays[cast(int, mb) % len(delays)]
                    if ready > now:
                        now = ready
                now += backward[stage]
            elif kind is Kind.OVERLAP:
                return None
            else:
                now += duration[kind][stage]
                index += 1
                continue
            ended[key] = now
            if key in waiting:
                work.append(waiting.pop(key))
            index += 1
        position[rank], clock[rank] = index, now
    if any(at < len(order) for at, order in zip(position, orders)):
        return None  # it would wait for ever; building it reports why
    return max(clock, default=0.0)
