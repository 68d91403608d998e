"""Each rank's link to the host weight store, for schedules that ``LOAD`` and ``OFFLOAD``.

A ``LOAD s`` occupies the rank's link from the host, not its compute: the rank issues it
and goes on, the weights cross when the link is free (a rank's loads one after another,
in the order it issues them), and a pass of stage ``s`` waits until they have arrived. So
a ``LOAD`` written ahead (a prefetch) overlaps the compute before it. An ``OFFLOAD s``
after the stage's backwards sends its gradients the other way, on the link to the host
(the two ways are separate, as PCIe's are), without holding the rank up; one after
forwards only frees the weights and takes no time. Ranks do not share the host's memory
bandwidth here: each link is the rank's own.
"""

from __future__ import annotations

from pipetrain.schedules import Kind, Schedule
from pipetrain.simulation.costs import Costs

_GRADIENT_KINDS = frozenset({Kind.BACKWARD, Kind.WEIGHT})


class HostLinks:
    """When each rank's two ways to the host are free, and when each loaded stage's weights
    have arrived."""

    def __init__(self, schedule: Schedule, costs: Costs) -> None:
        """Every link free from time 0; the costs of ``schedule``'s stages from ``costs``."""
        self._load = costs.per_stage("load_s", schedule.stages)
        self._offload = costs.per_stage("offload_s", schedule.stages)
        self._from_host = [0.0] * schedule.num_ranks
        self._to_host = [0.0] * schedule.num_ranks
        self._arrived: dict[tuple[int, int], float] = {}  # (rank, stage) -> weights there
        self._returning = _gradient_offloads(schedule)

    def ready(self, rank: int, stage: int) -> float:
        """When ``stage``'s weights are on ``rank`` for a pass (0 if never loaded)."""
        return self._arrived.get((rank, stage), 0.0)

    def move(
        self, rank: int, index: int, kind: Kind, stage: int, now: float
    ) -> tuple[float, float]:
        """Play the ``LOAD`` or ``OFFLOAD`` at ``index`` of ``rank``'s lane, issued at
        ``now``; its start and end on the link."""
        if kind is Kind.LOAD:
            start = max(now, self._from_host[rank])
            end = self._from_host[rank] = start + self._load[stage]
            self._arrived[(rank, stage)] = end
            return start, end
        if (rank, index) not in self._returning:
            return now, now
        start = max(now, self._to_host[rank])
        end = self._to_host[rank] = start + self._offload[stage]
        return start, end


def _gradient_offloads(schedule: Schedule) -> set[tuple[int, int]]:
    """The (rank, index) of each ``OFFLOAD`` that returns gradients: a backward or weight
    pass of its stage ran on the rank since the stage's ``LOAD``."""
    returning = set()
    for rank, lane in enumerate(schedule.ranks):
        computed: set[int] = set()  # resident stages with gradients
        for index, action in enumerate(lane):
            if action.kind in _GRADIENT_KINDS:
                computed.add(action.stage)
            elif action.kind is Kind.OFFLOAD and action.stage in computed:
                computed.discard(action.stage)
                returning.add((rank, index))
    return returning
