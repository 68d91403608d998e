"""Sharded stages' gathers as actions of the schedule.

A stage sharded over its replicas (``PipelineConfig(shard=True)``) holds a shard of its
parameters between steps; before the step's first pass each replica all-gathers the whole
(``GATHER s``, a collective over the stage's replicas), and its ``ALLREDUCE`` after the
last backward reduce-scatters the gradients and frees the gathered copy. As actions, the
gathers are validated (a collective every replica reaches, before any pass of the stage),
simulated (``Costs.gather_s``) and recorded like every other action.

Each rank gathers its sharded stages at the start of its lane, in increasing stage order:
every replica reaches them first thing, so they cannot deadlock, and a later stage's
gather runs while the pipeline fills, before its first activation arrives.
"""

from __future__ import annotations

from dataclasses import replace

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.validate import validate


def with_gathers(schedule: Schedule) -> Schedule:
    """``schedule`` with a ``GATHER`` of every replicated stage at the start of each of its
    replicas' lanes (validated); the schedule itself if no stage is replicated or it has
    its gathers already."""
    if any(action.kind is Kind.GATHER for lane in schedule.ranks for action in lane):
        return schedule
    sharded = [stage for stage, ranks in enumerate(schedule.stage_ranks) if len(ranks) > 1]
    if not sharded:
        return schedule
    lanes = []
    for rank, lane in enumerate(schedule.ranks):
        gathers = tuple(
            Action(Kind.GATHER, stage) for stage in sharded if rank in schedule.stage_ranks[stage]
        )
        lanes.append(gathers + lane)
    gathered = replace(schedule, ranks=tuple(lanes))
    validate(gathered)
    return gathered
