"""Simulation: play a schedule against costs and predict its timeline.

- :mod:`~pipetrain.simulation.costs`: :class:`Costs` and :class:`Variation`;
- :mod:`~pipetrain.simulation.engine`: :func:`simulate` and :func:`median_makespan`;
- :mod:`~pipetrain.simulation.ports`: each rank's link each way, which its messages share;
- :mod:`~pipetrain.simulation.measured`: costs recovered from measured timelines.
"""

from pipetrain.simulation.costs import Costs, PerStage, Variation
from pipetrain.simulation.engine import median_makespan, simulate
from pipetrain.simulation.measured import measured_costs, transfer_time

__all__ = [
    "Costs",
    "PerStage",
    "Variation",
    "measured_costs",
    "median_makespan",
    "simulate",
    "transfer_time",
]
