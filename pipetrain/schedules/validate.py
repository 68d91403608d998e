"""The schedule validator: a schedule it rejects never reaches the simulator or the runtime.

It checks placement (each action on a rank that holds its stage), coverage (every
micro-batch of every stage forwarded and backwarded exactly once, backward after forward),
the flush of synchronous schedules, a sharded stage's gather before its passes, the
residency of stages whose weights live in a host store
(:mod:`~pipetrain.schedules.residency`), overlapped pairs, the weight-version rules of
asynchronous ones (:mod:`~pipetrain.schedules.versions`),
and then executes the schedule abstractly (:mod:`~pipetrain.schedules.execution`) — sends
never block, a receive waits for its message, an all-reduce or a gather for every member of
its group — to find deadlocks, data used before it exists, and channels whose messages would
be matched out of order.

Every check is linear in the number of actions, and each lane is read in Python once: that
pass also finds where a rank would first use data it does not have, so the execution visits
only the actions that may wait (sends, receives, collectives). A rank's progress and the
messages it has received are kept in flat lists over the micro-batches of the stages it
holds, not in dicts of new keys: a large schedule's lanes would otherwise make and keep an
object per pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipetrain.schedules.actions import (
    COMPUTE_KINDS,
    HOST_KINDS,
    RECV_KINDS,
    Kind,
)
from pipetrain.schedules.errors import ScheduleError
from pipetrain.schedules.execution import Lane, execute
from pipetrain.schedules.messages import CARRIES, NEEDS
from pipetrain.schedules.residency import check_residency
from pipetrain.schedules.versions import check_versions

if TYPE_CHECKING:
    from pipetrain.schedules.schedule import Schedule


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` if ``schedule`` could deadlock or breaks a training rule."""
    host = schedule.host_stored  # the host steps its stages: no STEP on the workers
    if host:
        check_residency(schedule)
    lanes = _check_lanes(schedule, steps=not host)
    schedule.overlapped  # noqa: B018  # finding the pairs checks them; the simulator reuses them
    if schedule.asynchronous:
        check_versions(schedule)
    execute(schedule, lanes)


def _check_lanes(schedule: Schedule, steps: bool = True) -> list[Lane]:
    """Each action on a rank holding its stage, each compute where routing puts it and in
    order, every (kind, stage, micro-batch) once, and (with ``steps``) a synchronous stage
    stepped once after all of its rank's work on it; each rank's :class:`Lane`.

    Whether an action uses data the rank has depends only on what comes before it in its own
    lane (a receive either yields its own message or fails), so it is found here, in one
    pass per lane; the abstract execution raises it only when the rank gets that far."""
    expected = {Kind.FORWARD, Kind.BACKWARD} | ({Kind.WEIGHT} if schedule.split_backward else set())
    stage_ranks, stages, microbatches = schedule.stage_ranks, schedule.stages, schedule.microbatches
    synchronous, local = not schedule.asynchronous, {Kind.OVERLAP, *HOST_KINDS}
    forward, backward, weight, step, gather = (
        Kind.FORWARD,
        Kind.BACKWARD,
        Kind.WEIGHT,
        Kind.STEP,
        Kind.GATHER,
    )
    compute, receives, carries = COMPUTE_KINDS, RECV_KINDS, CARRIES.get
    # a micro-batch's passes on a stage come in this order; its progress counts them
    pass_order = {forward: 0, backward: 1, weight: 2}
    place_of = {kind: pass_order[kind] for kind in expected}.get
    covered = 0
    checked = []
    holds: dict[int, list[int]] = {}  # the stages each rank holds, in increasing order
    for stage, ranks in enumerate(stage_ranks):
        for rank in ranks:
            holds.setdefault(rank, []).append(stage)
    for rank, lane in enumerate(schedule.ranks):
        held = {stage for stage in holds.get(rank, ()) if stage < stages}
        # where routing is implied by placement: the held stages without replicas
        alone = {stage for stage in held if len(stage_ranks[stage]) == 1}
        # a held stage's micro-batches are numbered from its first: base[stage] + mb
        base = {stage: i * microbatches for i, stage in enumerate(sorted(held))}
        unheld = len(held) * microbatches  # where the micro-batches of any other stage are
        inputs = _inputs(held, stage_ranks, base, unheld, pass_order)
        # passes run of each numbered micro-batch, then of a stage beyond the schedule's that
        # the placement gives the rank (none run)
        progress = [0] * (unheld + microbatches)
        # which numbered micro-batches' activations and gradients have been received
        received = {receive: bytearray(len(progress)) for receive in _CARRIERS}
        stepped: set[int] = set()
        waits: list[int] = []
        early = nowhere = len(lane)  # the first use of data too early: none yet
        for index, action in enumerate(lane):
            kind, stage, mb, _, _ = action
            if stage not in held or (mb is not None and not 0 <= mb < microbatches):
                raise _misplaced(schedule, rank, index)
            place = place_of(kind)
            if place is not None:
                if mb is None:
                    raise _misordered(schedule, rank, index, stepped)
                key = base[stage] + mb
                done = progress[key]
                if done != place or (synchronous and stage in stepped):
                    raise _misordered(schedule, rank, index, stepped)
                if stage not in alone:
                    replicas = stage_ranks[stage]  # messages.rank_of, inline
                    if replicas[mb % len(replicas)] != rank:
                        raise _misordered(schedule, rank, index, stepped)
                progress[key] = done + 1
                if early == nowhere:
                    source = inputs[place].get(stage)
                    if source is None:  # from the step's data, or its own earlier pass
                        continue
                    replicas, where, produced, receive = source
                    if replicas[mb % len(replicas)] == rank:  # its own pass made the input
                        if progress[where + mb] <= produced:
                            early = index
                    elif not received[receive][key]:
                        early = index
            elif kind in compute:
                raise _misordered(schedule, rank, index, stepped)
            elif kind is step:
                if synchronous:
                    if stage in stepped:
                        raise ScheduleError(
                            f"rank {rank}: stage {stage} has 2 optimizer steps, expected 1",
                            lane,
                            rank,
                            index,
                        )
                    stepped.add(stage)
            elif kind not in local:  # a send, a receive or a collective: it may wait
                waits.append(index)
                if kind is gather and any(progress[base[stage] : base[stage] + microbatches]):
                    raise ScheduleError(
                        f"rank {rank}: {action} comes after a pass of stage {stage}; a "
                        "sharded stage is gathered before its first pass",
                        lane,
                        rank,
                        index,
                    )
                if kind in receives:
                    if mb is not None and kind in received:
                        received[kind][base[stage] + mb] = 1
                elif early == nowhere:
                    carried = carries(kind)
                    if carried is not None and (
                        mb is None or progress[base[stage] + mb] <= pass_order[carried]
                    ):
                        early = index
        covered += sum(progress)
        if synchronous and steps:
            for stage in holds.get(rank, ()):
                if stage not in stepped:
                    raise ScheduleError(
                        f"rank {rank}: stage {stage} has 0 optimizer steps, expected 1"
                    )
        checked.append(Lane(waits, early))
    if covered != len(expected) * stages * microbatches:
        _report_missing(schedule, expected)
    return checked


Input = tuple[tuple[int, ...], int, int, Kind]
"""Where a pass of one kind and stage takes its input from: the source stage's replicas
(``(-1,)`` where none holds it), the number of that stage's first micro-batch in a lane's
progress where the rank holds it, the producing pass's place in :func:`_check_lanes`'
order, and the receive kind that brings it from another rank."""

_CARRIERS = tuple(receive for receive, _, _ in NEEDS.values())
"""The receive kinds a pass may wait for (a forward's activations, a backward's gradients)."""


def _inputs(
    held: set[int],
    stage_ranks: tuple[tuple[int, ...], ...],
    base: dict[int, int],
    unheld: int,
    pass_order: dict[Kind, int],
) -> tuple[dict[int, Input], ...]:
    """By pass (forward, backward, weight), each held stage whose pass takes its input from
    a neighbouring stage -> its :data:`Input`; ``base`` numbers the held stages'
    micro-batches, and any other stage's from ``unheld``."""
    found: tuple[dict[int, Input], ...] = ({}, {}, {})
    for kind, (receive, produce, offset) in NEEDS.items():
        for stage in held:
            source = stage + offset
            if 0 <= source < len(stage_ranks):
                found[pass_order[kind]][stage] = (
                    stage_ranks[source] or (-1,),  # held by none: placement or coverage fails
                    base.get(source, unheld),
                    pass_order[produce],
                    receive,
                )
    return found


def _misplaced(schedule: Schedule, rank: int, index: int) -> ScheduleError:
    lane = schedule.ranks[rank]
    action = lane[index]
    stage, mb = action.stage, action.microbatch
    if not 0 <= stage < schedule.stages:
        message = f"{action} names stage {stage}, outside 0..{schedule.stages - 1}"
    elif rank not in schedule.stage_ranks[stage]:
        message = f"{action} belongs to stage {stage}, held by ranks {schedule.stage_ranks[stage]}"
    else:
        message = f"{action} names micro-batch {mb} of {schedule.microbatches}"
    return ScheduleError(f"rank {rank}: {message}", lane, rank, index)


def _misordered(schedule: Schedule, rank: int, index: int, stepped: set[int]) -> ScheduleError:
    lane = schedule.ranks[rank]
    action = lane[index]
    seen = {a[:3] for a in lane[:index] if a.kind in COMPUTE_KINDS}
    kind, stage, mb = action.kind, action.stage, action.microbatch
    if mb is None:
        message = f"{action} names no micro-batch"
    elif kind is Kind.WEIGHT and not schedule.split_backward:
        message = f"{action} is a {kind.value}, which this schedule does not use"
    elif schedule.rank_of(stage, mb) != rank:
        message = f"{action} should run on rank {schedule.rank_of(stage, mb)}"
    elif (kind, stage, mb) in seen:
        count = sum(1 for a in lane if a[:3] == (kind, stage, mb))
        return ScheduleError(
            f"{kind.value} of stage {stage} micro-batch {mb} appears {count} times, expected once",
            lane,
            rank,
            index,
        )
    elif kind is Kind.BACKWARD and (Kind.FORWARD, stage, mb) not in seen:
        message = f"{action} runs before its forward"
    elif kind is Kind.WEIGHT and (Kind.BACKWARD, stage, mb) not in seen:
        message = f"{action} runs before its backward"
    else:
        message = f"stage {stage} steps the optimizer before {action}"
    return ScheduleError(f"rank {rank}: {message}", lane, rank, index)


def _report_missing(schedule: Schedule, expected: set[Kind]) -> None:
    present = {
        (a.kind, a.stage, a.microbatch)
        for lane in schedule.ranks
        for a in lane
        if a.kind in expected
    }
    for kind in sorted(expected):
        for stage in range(schedule.stages):
            for mb in range(schedule.microbatches):
                if (kind, stage, mb) not in present:
                    raise ScheduleError(
                        f"{kind.value} of stage {stage} micro-batch {mb} appears 0 times, "
                        "expected once"
                    )
