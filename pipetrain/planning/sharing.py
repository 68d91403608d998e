"""Workers that share a machine's cores: what a simulated step costs when more of them
compute at once than there are cores.

Each worker's profile says how long its actions take with a core to itself. When ``W``
workers share ``C < W`` cores (local workers, or the hosts of an emulated cluster on one
machine), the pipeline's actions stretch whenever more than ``C`` of them run at once. A
pipeline with bubbles keeps fewer busy than one without, so the stretch depends on the
schedule: this module finds it as the fixed point of a processor-sharing model averaged over
the step. The ranks' work needs ``B`` core-seconds (their busy time with a core each: the
compute, and the packing and copying of every message, which takes a core too); with every
such action stretched by ``f`` the step takes ``M(f)``, in which the cores give ``C·M(f)``
core-seconds, so ``f`` is the smallest stretch, at least 1, with ``B ≤ C·M(f)``: 1 when the
pipeline's bubbles leave cores free, else the stretch at which the step is as long as its
work spread over the cores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pipetrain.schedules import RECV_KINDS, SEND_KINDS
from pipetrain.simulation import Costs
from pipetrain.simulation.costs import PerStage
from pipetrain.timeline import Timeline

# what a core does: compute, and each message's packing (sender) and copying in (receiver)
_CORE_FIELDS = ("forward_s", "backward_s", "weight_s", "step_s", "send_s", "receive_s")
_SENDS = frozenset(kind.value for kind in SEND_KINDS)
_RECEIVES = frozenset(kind.value for kind in RECV_KINDS)
_BISECTIONS = 12  # the stretch to within (workers / cores) / 4096


def core_time(timeline: Timeline, receive_s: float) -> float:
    """The core-seconds a simulated step's ranks work: their compute, their sends (the
    packing the simulator charges there) and ``receive_s`` for every receive's copy (a
    receive's event is mostly waiting)."""
    total = 0.0
    for rank in range(timeline.num_ranks):
        total += timeline.busy_time(rank)
        for event in timeline.rank_events(rank):
            if event.kind in _SENDS:
                total += event.duration
            elif event.kind in _RECEIVES:
                total += receive_s
    return total


def stretched(costs: Costs, factor: float) -> Costs:
    """``costs`` with every time a core works (forward, backward, weight, optimizer step,
    a message's packing and copying) times ``factor``; links and latencies unchanged."""

    def scale(value: PerStage) -> PerStage:
        if isinstance(value, (int, float)):
            return value * factor
        return [v * factor for v in value]

    scaled: dict[str, Any] = {name: scale(getattr(costs, name)) for name in _CORE_FIELDS}
    return replace(costs, **scaled)


def shared_cores_stretch(
    simulate: Callable[[Costs], Timeline], costs: Costs, workers: int, cores: int
) -> tuple[float, Timeline]:
    """The compute stretch of ``workers`` sharing ``cores`` cores, and the step simulated with
    it. ``simulate`` runs the candidate's schedule on given costs; with at least as many
    cores as workers the stretch is 1 (one simulation)."""
    timeline = simulate(costs)
    if cores >= workers:
        return 1.0, timeline
    busy = core_time(timeline, costs.receive_s)
    if busy <= cores * timeline.makespan:
        return 1.0, timeline
    # B ≤ C·M(f) holds at f = workers / cores: M(f) is at least every rank's f·B_r
    low, high = 1.0, workers / cores
    best = simulate(stretched(costs, high))
    for _ in range(_BISECTIONS):
        middle = (low + high) / 2
        trial = simulate(stretched(costs, middle))
        if busy <= cores * trial.makespan:
            high, best = middle, trial
        else:
            low = middle
    return high, best
