"""Planning: split a profiled model into stages over a network and pick how to run them.

- :mod:`~pipetrain.planning.topology`: the network (levels of workers and link bandwidths);
- :mod:`~pipetrain.planning.partition`: exact minimum-bottleneck straight pipelines;
- :mod:`~pipetrain.planning.replicate` and :mod:`~pipetrain.planning.reach`: PipeDream's
  replicated, hierarchical planner and its feasibility tests;
- :mod:`~pipetrain.planning.depths`: the least-bottleneck replicated pipeline of each depth;
- :mod:`~pipetrain.planning.memory`: per-worker peak memory for each schedule;
- :mod:`~pipetrain.planning.candidates`: layouts and candidates, asked of the schedule specs;
- :mod:`~pipetrain.planning.fitting`: the candidates that fit the memory limit;
- :mod:`~pipetrain.planning.planner`: :func:`plan`, which simulates candidates and picks one;
- :mod:`~pipetrain.planning.result`: the :class:`Plan` it returns.
"""

from pipetrain.planning.memory import StageFootprint, worker_memory
from pipetrain.planning.partition import balance_by_time, bottleneck, partition
from pipetrain.planning.planner import plan
from pipetrain.planning.replicate import ReplicatedStage, Replication, replicate
from pipetrain.planning.result import Plan, PlanStage
from pipetrain.planning.topology import Level, Topology
from pipetrain.schedules import RECOMPUTE_MODES

__all__ = [
    "RECOMPUTE_MODES",
    "Level",
    "Plan",
    "PlanStage",
    "ReplicatedStage",
    "Replication",
    "StageFootprint",
    "Topology",
    "balance_by_time",
    "bottleneck",
    "partition",
    "plan",
    "replicate",
    "worker_memory",
]
