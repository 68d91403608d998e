"""Workers that share a machine's cores: what a simulated step costs when more of them
work at once than there are cores.

Each worker's profile says how long its actions take with a core to itself. When ``W``
workers share ``C < W`` cores (local workers, or the hosts of an emulated cluster on one
machine), the pipeline's actions stretch whenever more than ``C`` of them run at once. A
pipeline with bubbles keeps fewer busy than one without, and data parallelism keeps every
worker busy at the same moments, so the stretch depends on when the schedule works: this
module finds it by processor sharing over the simulated step. Work is compute and each
message's packing and copying, which take a core too. While ``n`` workers work at once,
each gets ``min(1, C / n)`` of a core, so an action that needs ``w`` core-seconds lasts
until it has received them. A stage's actions, and the messages, are stretched by a factor
of their own: the time they last over the core time they receive in the step simulated
with the factors so far, iterated to a fixed point (each round moves halfway). Compute
also takes more core time on shared cores than alone (the profile's
``shared_cores_factor``: caches refilled after other workers ran, threads switched), by
which every stage's compute is multiplied first; a message's costs were measured on the
shared cores already.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import replace

from pipetrain.schedules import RECV_KINDS, SEND_KINDS
from pipetrain.schedules.messages import CHANNELS
from pipetrain.simulation import Costs
from pipetrain.timeline import BUSY_KINDS, Timeline

_STAGE_FIELDS = ("forward_s", "backward_s", "weight_s", "step_s")
# a message's packing and copying in
_MESSAGE_FIELDS = ("send_s", "receive_s", "send_byte_s", "receive_byte_s")
_SENDS = frozenset(kind.value for kind in SEND_KINDS)
# a receive's kind -> (the offset of its boundary from its stage, whether it is whole-step)
_RECEIVES = {kind.value: (CHANNELS[kind][1], CHANNELS[kind][2]) for kind in RECV_KINDS}
_ROUNDS = 16
_SETTLED = 1e-3  # factors that move less than this between rounds have converged

MESSAGES = -1
"""The key of the messages' factor beside the stages' in a factor mapping."""


def stretched(costs: Costs, factors: Mapping[int, float], stages: int) -> Costs:
    """``costs`` with each stage's compute times (forward, backward, weight, optimizer step)
    times its factor in ``factors`` (1 where absent) and a message's packing and copying
    (per message and per byte) times ``factors[MESSAGES]``; links and latencies unchanged."""
    scaled: dict[str, object] = {
        name: [
            value * factors.get(stage, 1.0)
            for stage, value in enumerate(costs.per_stage(name, stages))
        ]
        for name in _STAGE_FIELDS
    }
    for name in _MESSAGE_FIELDS:
        scaled[name] = getattr(costs, name) * factors.get(MESSAGES, 1.0)
    return replace(costs, **scaled)  # type: ignore[arg-type]


def _work_intervals(
    timeline: Timeline, costs: Costs, stages: int
) -> list[tuple[float, float, int]]:
    """``(start, end, key)`` of every stretch of core work in ``timeline``: compute keyed by
    its stage, a send (the packing the simulator charges there) and the end of a receive
    that copies its message in (the rest is waiting) keyed :data:`MESSAGES`."""
    sizes = costs.per_stage("activation_bytes", max(stages - 1, 1))
    intervals = []
    for event in timeline.events:
        if event.kind in BUSY_KINDS and event.stage is not None:
            intervals.append((event.start, event.end, event.stage))
        elif event.kind in _SENDS:
            intervals.append((event.start, event.end, MESSAGES))
        elif event.kind in _RECEIVES and event.stage is not None:
            offset, whole_step = _RECEIVES[event.kind]
            copy_s = costs.receive_busy_s(0.0 if whole_step else sizes[event.stage + offset])
            intervals.append((max(event.start, event.end - copy_s), event.end, MESSAGES))
    return [interval for interval in intervals if interval[1] > interval[0]]


def _implied_factors(intervals: list[tuple[float, float, int]], cores: int) -> dict[int, float]:
    """Per key, the time its intervals last over the core time processor sharing gives them
    (each of ``n`` intervals running at once gets ``min(1, cores / n)`` of a core)."""
    points = sorted({t for start, end, _ in intervals for t in (start, end)})
    change = [0] * len(points)
    for start, end, _ in intervals:
        change[bisect.bisect_left(points, start)] += 1
        change[bisect.bisect_left(points, end)] -= 1
    received = [0.0]  # core time one working interval has received by each point
    load = 0
    for index in range(len(points) - 1):
        load += change[index]
        share = min(1.0, cores / load) if load else 1.0
        received.append(received[-1] + share * (points[index + 1] - points[index]))
    lasted: dict[int, float] = defaultdict(float)
    given: dict[int, float] = defaultdict(float)
    for start, end, key in intervals:
        lasted[key] += end - start
        given[key] += (
            received[bisect.bisect_left(points, end)] - received[bisect.bisect_left(points, start)]
        )
    return {key: lasted[key] / given[key] for key in lasted if given[key] > 0}


def shared_cores_stretch(
    simulate: Callable[[Costs], Timeline],
    costs: Costs,
    stages: int,
    workers: int,
    cores: int,
    slowdown: float = 1.0,
) -> tuple[Costs, Timeline]:
    """The costs of ``workers`` sharing ``cores`` cores (``costs`` with every stage's compute
    times ``slowdown``, then stretched per stage and for messages) and the step simulated
    on them. ``simulate`` runs the candidate's schedule, of ``stages`` stages, on given
    costs; with at least as many cores as workers nothing changes (one simulation)."""
    if cores >= workers:
        return costs, simulate(costs)
    costs = stretched(costs, dict.fromkeys(range(stages), slowdown), stages)
    timeline = simulate(costs)
    factors: dict[int, float] = {}
    current = costs
    for _ in range(_ROUNDS):
        implied = _implied_factors(_work_intervals(timeline, current, stages), cores)
        moved = {
            key: (factors.get(key, 1.0) + max(value, 1.0)) / 2 for key, value in implied.items()
        }
        settled = all(abs(moved[key] - factors.get(key, 1.0)) < _SETTLED for key in moved)
        factors = moved
        current = stretched(costs, factors, stages)
        timeline = simulate(current)
        if settled:
            break
    return current, timeline
