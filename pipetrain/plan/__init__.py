"""Planning: split a profiled model into stages over a network and pick how to run them.

- :mod:`~pipetrain.plan.topology`: the network (levels of workers and link bandwidths);
- :mod:`~pipetrain.plan.partition`: exact minimum-bottleneck straight pipelines;
- :mod:`~pipetrain.plan.replicate`: PipeDream's replicated, hierarchical planner;
- :mod:`~pipetrain.plan.memory`: per-worker peak memory for each schedule;
- :mod:`~pipetrain.plan.planner`: :func:`plan`, which simulates candidates and picks one.
"""

from pipetrain.plan.memory import StageFootprint, worker_memory
from pipetrain.plan.partition import balance_by_time, bottleneck, partition
from pipetrain.plan.planner import CHECKPOINT_MODES, Plan, PlanStage, plan
from pipetrain.plan.replicate import ReplicatedStage, Replication, replicate
from pipetrain.plan.topology import Level, Topology

__all__ = [
    "CHECKPOINT_MODES",
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
