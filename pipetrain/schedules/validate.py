"""The schedule validator: a schedule it rejects never reaches the simulator or the runtime.

It checks placement (each action on a rank that holds its stage), coverage (every
micro-batch of every stage forwarded and backwarded exactly once, backward after forward),
the flush of synchronous schedules, a sharded stage's gather before its passes, the
residency of stages whose weights live in a host store
(:mod:`~pipetrain.schedules.residency`), overlapped pairs, the weight-version rules of
asynchronous ones (:mod:`~pipetrain.schedules.versions`),
and then executes the schedule abstractly — sends never block, a receive waits for its
message, an all-reduce or a gather for every member of its group — to find deadlocks, data
used before it exists, and channels whose messages would be matched out of order.

Every check is linear in the number of actions, and each lane is read in Python once: that
pass also finds where a rank would first use data it does not have, so the execution visits
only the actions that may wait (sends, receives, collectives).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter, defaultdict, deque
from typing import TYPE_CHECKING, NamedTuple

from pipetrain.schedules.actions import (
    COMPUTE_KINDS,
    HOST_KINDS,
    RECV_KINDS,
    SEND_KINDS,
    Action,
    Kind,
)
from pipetrain.schedules.errors import ScheduleError
from pipetrain.schedules.messages import CARRIES, NEEDS, RECEIVES
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
    _execute(schedule, lanes)


class _Lane(NamedTuple):
    """What the abstract execution needs of a rank's actions: the indices of its sends,
    receives and collectives (compute never waits), and the first index that uses data the
    rank does not have yet (its length if none)."""

    waits: list[int]
    early: int


def _check_lanes(schedule: Schedule, steps: bool = True) -> list[_Lane]:
    """Each action on a rank holding its stage, each compute where routing puts it and in
    order, every (kind, stage, micro-batch) once, and (with ``steps``) a synchronous stage
    stepped once after all of its rank's work on it; each rank's :class:`_Lane`.

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
        inputs = _inputs(held, stage_ranks, microbatches, pass_order)
        progress: dict[int, int] = {}  # stage · microbatches + micro-batch -> passes run
        received: set[tuple[Kind, int, int | None]] = set()
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
                key = stage * microbatches + mb
                done = progress.get(key, 0)
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
                        if progress.get(where + mb, 0) <= produced:
                            early = index
                    elif (receive, stage, mb) not in received:
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
                if kind is gather and any(
                    progress.get(stage * microbatches + k) for k in range(microbatches)
                ):
                    raise ScheduleError(
                        f"rank {rank}: {action} comes after a pass of stage {stage}; a "
                        "sharded stage is gathered before its first pass",
                        lane,
                        rank,
                        index,
                    )
                if kind in receives:
                    received.add((kind, stage, mb))
                elif early == nowhere:
                    carried = carries(kind)
                    if carried is not None and (
                        mb is None
                        or progress.get(stage * microbatches + mb, 0) <= pass_order[carried]
                    ):
                        early = index
        covered += sum(progress.values())
        if synchronous and steps:
            for stage in holds.get(rank, ()):
                if stage not in stepped:
                    raise ScheduleError(
                        f"rank {rank}: stage {stage} has 0 optimizer steps, expected 1"
                    )
        checked.append(_Lane(waits, early))
    if covered != len(expected) * stages * microbatches:
        _report_missing(schedule, expected)
    return checked


Input = tuple[tuple[int, ...], int, int, Kind]
"""Where a pass of one kind and stage takes its input from: the source stage's replicas
(``(-1,)`` where none holds it), that stage's first key in a lane's progress (its index ·
microbatches), the producing pass's place in :func:`_check_lanes`' order, and the receive
kind that brings it from another rank."""


def _inputs(
    held: set[int],
    stage_ranks: tuple[tuple[int, ...], ...],
    microbatches: int,
    pass_order: dict[Kind, int],
) -> tuple[dict[int, Input], ...]:
    """By pass (forward, backward, weight), each held stage whose pass takes its input from
    a neighbouring stage -> its :data:`Input`."""
    found: tuple[dict[int, Input], ...] = ({}, {}, {})
    for kind, (receive, produce, offset) in NEEDS.items():
        for stage in held:
            source = stage + offset
            if 0 <= source < len(stage_ranks):
                found[pass_order[kind]][stage] = (
                    stage_ranks[source] or (-1,),  # held by none: placement or coverage fails
                    source * microbatches,
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


def _execute(schedule: Schedule, checked: list[_Lane]) -> None:
    """Play the schedule with non-blocking sends; raise on deadlock or misuse.

    Each rank runs until it blocks on a receive or a collective; the send or the last
    arrival that unblocks it puts it back on the work list, so every action runs once. Only
    the actions that may wait are visited (``checked``): a rank passing its early index
    uses data it does not have.
    """
    lanes, num_ranks, last = schedule.ranks, schedule.num_ranks, schedule.stages - 1
    stage_ranks = schedule.stage_ranks
    position = [0] * num_ranks  # into each rank's waits
    channels: dict[tuple[int, int], deque[tuple[Kind, int, int | None]]] = defaultdict(deque)
    blocked_on: dict[tuple[int, int], int] = {}  # (sender, receiver) -> receiver
    everyone = tuple(range(num_ranks))
    arrived: dict[tuple[Kind, int, int], dict[int, None]] = defaultdict(dict)  # in order
    collectives: list[Counter[tuple[Kind, int]]] = [Counter() for _ in range(num_ranks)]
    runnable = deque(range(num_ranks))
    # send kind -> (its receive kind, offset to the receiving stage); the targets go to the
    # last stage
    sends = {kind: RECEIVES.get(kind, (Kind.RECV_T, None)) for kind in SEND_KINDS}.get
    receives = RECV_KINDS
    # each rank's waits before its early index: passing them all uses data it lacks
    limits = [bisect_left(waits, early) for waits, early in checked]
    while runnable:
        rank = runnable.popleft()
        lane, waits = lanes[rank], checked[rank].waits
        at, limit = position[rank], limits[rank]
        while at < limit:
            kind, stage, mb, peer, _ = action = lane[waits[at]]
            found = sends(kind)
            if found is not None:
                pair = (rank, peer if peer is not None else -1)
                receive, offset = found
                channels[pair].append(
                    (receive, last, None) if offset is None else (receive, stage + offset, mb)
                )
                waiter = blocked_on.pop(pair, None)
                if waiter is not None:
                    runnable.append(waiter)
            elif kind in receives:
                pair = (peer if peer is not None else -1, rank)
                queue = channels[pair]
                if not queue:
                    blocked_on[pair] = rank
                    break
                head = queue.popleft()
                if head != (kind, stage, mb):
                    raise ScheduleError(
                        f"rank {rank}: {action} would be matched with {Action(*head)}, "
                        f"the next message rank {action.peer} sends on that channel",
                        lane,
                        rank,
                        waits[at],
                    )
            else:  # ALLREDUCE, GATHER or LOSS
                position[rank] = at
                if not _arrive(
                    rank, action, stage_ranks, everyone, arrived, collectives, position, runnable
                ):
                    break
                at = position[rank]
                continue
            at += 1
        position[rank] = at
        if at == limit and checked[rank].early < len(lane):
            raise _used_too_early(schedule, rank, checked[rank].early)
    reached = [
        waits[at] if at < len(waits) else len(lane)
        for lane, (waits, _), at in zip(lanes, checked, position)
    ]
    _report_stuck(schedule, reached, channels)


def _arrive(
    rank: int,
    action: Action,
    stage_ranks: tuple[tuple[int, ...], ...],
    everyone: tuple[int, ...],
    arrived: dict[tuple[Kind, int, int], dict[int, None]],
    collectives: list[Counter[tuple[Kind, int]]],
    position: list[int],
    runnable: deque[int],
) -> bool:
    """``rank`` reaches a collective (an all-reduce or a gather over the stage's replicas,
    the loss over every rank); when it is the last to arrive, every member moves past it
    and the others go back on the work list. Returns whether ``rank`` moved past it."""
    kind = action.kind
    group, scope = (everyone, 0) if kind is Kind.LOSS else (stage_ranks[action.stage], action.stage)
    members = arrived[(kind, scope, collectives[rank][(kind, scope)])]
    members.setdefault(rank)
    if len(members) < len(group):
        return False
    for member in members:
        collectives[member][(kind, scope)] += 1
        position[member] += 1
        if member != rank:
            runnable.append(member)
    return True


def _used_too_early(schedule: Schedule, rank: int, index: int) -> ScheduleError:
    """The error for a compute action whose input, or a send whose tensor, the rank does
    not have yet."""
    lane = schedule.ranks[rank]
    action = lane[index]
    carried = CARRIES.get(action.kind)
    if carried is not None:
        text = f"{carried.value}{action.stage}.{action.microbatch}"
        return ScheduleError(
            f"rank {rank}: {action} sends before computing {text}", lane, rank, index
        )
    receive, produce, offset = NEEDS[action.kind]
    source, mb = action.stage + offset, action.microbatch
    local = mb is not None and schedule.rank_of(source, mb) == rank
    what = f"{produce.value}{source}.{mb}" if local else f"its {receive.value}"
    return ScheduleError(f"rank {rank}: {action} runs before {what}", lane, rank, index)


def _report_stuck(
    schedule: Schedule,
    position: list[int],
    channels: dict[tuple[int, int], deque[tuple[Kind, int, int | None]]],
) -> None:
    stuck = [
        rank for rank in range(schedule.num_ranks) if position[rank] < len(schedule.ranks[rank])
    ]
    if stuck:
        waits = ", ".join(
            f"rank {rank} at {schedule.ranks[rank][position[rank]]}" for rank in stuck
        )
        first = stuck[0]
        raise ScheduleError(
            f"{schedule.name} deadlocks: {waits}", schedule.ranks[first], first, position[first]
        )
    for (sender, receiver), queue in channels.items():
        if queue:
            raise ScheduleError(
                f"rank {sender} sends {Action(*queue[0])} to rank {receiver}, "
                "which never receives it"
            )
