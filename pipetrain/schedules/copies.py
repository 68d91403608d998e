"""A pipeline schedule played by several copies side by side: data parallelism outside the
schedule, for families whose stages are not replicated inside it (zero-bubble, interleaved,
the V schedules).

Copy ``d`` of a schedule on ``p`` ranks runs on ranks ``r·n + d`` (``n`` copies, the
pipeline dimension outermost, as replicated stages are laid out) and takes micro-batches
``k·n + d``: a stage's replicas then share its micro-batches round-robin, as the schedule
IR routes them. Before every optimizer step each stage all-reduces (or, sharded,
reduce-scatters) its gradients over its replicas, after the stage's last backward and
weight-gradient pass.
"""

from __future__ import annotations

from dataclasses import replace

from pipetrain.checks import positive_int
from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.validate import validate


def data_parallel_copies(schedule: Schedule, copies: int) -> Schedule:
    """``copies`` copies of the synchronous ``schedule`` on ``copies`` times its ranks,
    playing ``copies`` times its micro-batches; ValueError for an asynchronous schedule
    (its weight versions are per rank) or one already replicated."""
    positive_int("copies", copies)
    if copies == 1:
        return schedule
    if schedule.asynchronous:
        raise ValueError(
            f"{schedule.name} updates inside the step, so its copies' weights would part; "
            "replicate its stages instead (replicas=...)"
        )
    if any(len(ranks) > 1 for ranks in schedule.stage_ranks):
        raise ValueError(f"{schedule.name} already replicates stages; copy an unreplicated one")
    # rank-major: rank r's copies side by side are global ranks r·copies + d
    programs = [
        tuple(_copied(actions, copies, copy))
        for actions in schedule.ranks
        for copy in range(copies)
    ]
    copied = replace(
        schedule,
        microbatches=schedule.microbatches * copies,
        ranks=tuple(programs),
        stage_ranks=tuple(
            tuple(rank * copies + copy for rank in ranks for copy in range(copies))
            for ranks in schedule.stage_ranks
        ),
    )
    validate(copied)
    return copied


def _copied(actions: tuple[Action, ...], copies: int, copy: int) -> list[Action]:
    program = []
    for action in actions:
        if action.kind is Kind.STEP:
            program.append(Action(Kind.ALLREDUCE, action.stage))
        mb = action.microbatch
        peer = action.peer
        program.append(
            action._replace(
                microbatch=None if mb is None else mb * copies + copy,
                peer=None if peer is None else peer * copies + copy,
            )
        )
    return program
