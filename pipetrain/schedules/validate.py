"""The schedule validator: a schedule it rejects never reaches the simulator or the runtime.

It checks placement (each action on a rank that holds its stage), coverage (every
micro-batch of every stage forwarded and backwarded exactly once, backward after forward),
the flush of synchronous schedules, overlapped pairs, the weight-version rules of
asynchronous ones, and then executes the schedule abstractly — sends never block, a receive
waits for its message, an all-reduce for every member of its group — to find deadlocks,
data used before it exists, and channels whose messages would be matched out of order.
Every check is linear in the number of actions.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pipetrain.schedules.actions import COMPUTE_KINDS, RECV_KINDS, SEND_KINDS, Action, Kind
from pipetrain.schedules.errors import ScheduleError
from pipetrain.schedules.messages import CARRIES, NEEDS, RECEIVES, rank_of
from pipetrain.schedules.overlap import check_pairs

if TYPE_CHECKING:
    from pipetrain.schedules.schedule import Schedule


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` if ``schedule`` could deadlock or breaks a training rule."""
    _check_placement_and_coverage(schedule)
    check_pairs(schedule.ranks)
    if schedule.asynchronous:
        _check_versions(schedule)
    _execute(schedule)


def _check_placement_and_coverage(schedule: Schedule) -> None:
    """Each action on a rank holding its stage, each compute where routing puts it and in
    order, every (kind, stage, micro-batch) once, and a synchronous stage stepped once after
    all of its rank's work on it."""
    expected = {Kind.FORWARD, Kind.BACKWARD} | ({Kind.WEIGHT} if schedule.split_backward else set())
    stage_ranks, stages, microbatches = schedule.stage_ranks, schedule.stages, schedule.microbatches
    synchronous = not schedule.asynchronous
    forward, backward, weight, step = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT, Kind.STEP
    covered = 0
    for rank, lane in enumerate(schedule.ranks):
        seen: set[tuple[Kind, int, int | None]] = set()
        stepped: set[int] = set()
        for index, action in enumerate(lane):
            kind, stage, mb = action.kind, action.stage, action.microbatch
            if (
                not 0 <= stage < stages
                or rank not in stage_ranks[stage]
                or (mb is not None and not 0 <= mb < microbatches)
            ):
                raise _misplaced(schedule, rank, index)
            if kind in COMPUTE_KINDS:
                key = (kind, stage, mb)
                if (
                    mb is None
                    or kind not in expected
                    or rank_of(stage_ranks, stage, mb) != rank
                    or key in seen
                    or (kind is backward and (forward, stage, mb) not in seen)
                    or (kind is weight and (backward, stage, mb) not in seen)
                    or (synchronous and stage in stepped)
                ):
                    raise _misordered(schedule, rank, index, seen, stepped)
                seen.add(key)
            elif kind is step and synchronous:
                if stage in stepped:
                    raise ScheduleError(
                        f"rank {rank}: stage {stage} has 2 optimizer steps, expected 1",
                        lane,
                        rank,
                        index,
                    )
                stepped.add(stage)
        covered += len(seen)
        if synchronous:
            for stage in schedule.stages_of(rank):
                if stage not in stepped:
                    raise ScheduleError(
                        f"rank {rank}: stage {stage} has 0 optimizer steps, expected 1"
                    )
    if covered != len(expected) * stages * microbatches:
        _report_missing(schedule, expected)


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


def _misordered(
    schedule: Schedule,
    rank: int,
    index: int,
    seen: set[tuple[Kind, int, int | None]],
    stepped: set[int],
) -> ScheduleError:
    lane = schedule.ranks[rank]
    action = lane[index]
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


def _check_versions(schedule: Schedule) -> None:
    """Each forward on a version already made, its backward and weight pass on the same one,
    each step producing the next, and no more live versions than ``max_versions``."""
    limit = schedule.options.get("max_versions")
    max_versions = limit if isinstance(limit, int) else None
    forward_version: dict[tuple[int, int | None], int] = {}
    for rank, lane in enumerate(schedule.ranks):
        steps: dict[int, int] = defaultdict(int)
        # in_use[stage][version]: forwards on that version whose backward is still to come
        in_use: dict[int, Counter[int]] = defaultdict(Counter)
        for index, action in enumerate(lane):
            kind, stage, mb, _, version = action
            problem = None
            if kind is Kind.STEP:
                steps[stage] += 1
                if version != steps[stage]:
                    problem = f"{action} should produce version {steps[stage]}"
            elif kind is Kind.FORWARD:
                if version is None or version > steps[stage]:
                    problem = (
                        f"{action} uses weight version {version}, but only "
                        f"{steps[stage]} updates have been applied"
                    )
                else:
                    forward_version[(stage, mb)] = version
                    in_use[stage][version] += 1
            elif kind is Kind.BACKWARD or kind is Kind.WEIGHT:
                used = forward_version.get((stage, mb))
                if version != used:
                    problem = f"{action} uses version {version} but its forward used {used}"
                elif kind is Kind.BACKWARD and version is not None:
                    held = in_use[stage]
                    held[version] -= 1
                    if not held[version]:
                        del held[version]
            if (
                problem is None
                and max_versions is not None
                and (kind is Kind.FORWARD or kind is Kind.STEP)
            ):
                live = len(in_use[stage]) + (steps[stage] not in in_use[stage])
                if live > max_versions:
                    problem = (
                        f"stage {stage} needs {live} weight versions at {action}, at most "
                        f"{max_versions} allowed"
                    )
            if problem is not None:
                raise ScheduleError(f"rank {rank}: {problem}", lane, rank, index)
    if schedule.options.get("vertical_sync"):
        for (stage, mb), version in forward_version.items():
            if version != forward_version[(0, mb)]:
                raise ScheduleError(
                    f"vertical sync: stage {stage} mini-batch {mb} uses version {version}, "
                    f"stage 0 used {forward_version[(0, mb)]}"
                )


def _execute(schedule: Schedule) -> None:
    """Play the schedule with non-blocking sends; raise on deadlock or misuse.

    Each rank runs until it blocks on a receive or a collective; the send or the last
    arrival that unblocks it puts it back on the work list, so every action runs once.
    """
    lanes, num_ranks, last = schedule.ranks, schedule.num_ranks, schedule.stages - 1
    stage_ranks = schedule.stage_ranks
    position = [0] * num_ranks
    done: list[set[tuple[Kind, int, int | None]]] = [set() for _ in range(num_ranks)]
    channels: dict[tuple[int, int], deque[tuple[Kind, int, int | None]]] = defaultdict(deque)
    blocked_on: dict[tuple[int, int], int] = {}  # (sender, receiver) -> receiver
    everyone = tuple(range(num_ranks))
    arrived: dict[tuple[Kind, int, int], list[int]] = defaultdict(list)
    collectives: list[Counter[tuple[Kind, int]]] = [Counter() for _ in range(num_ranks)]
    runnable = deque(range(num_ranks))
    compute, sends, receives = COMPUTE_KINDS, SEND_KINDS, RECV_KINDS
    needs, receives_of, carries = NEEDS.get, RECEIVES.get, CARRIES.get
    targets_key = (Kind.RECV_T, last, None)  # the targets go to the last stage
    while runnable:
        rank = runnable.popleft()
        lane, mine = lanes[rank], done[rank]
        index, end = position[rank], len(lane)
        while index < end:
            action = lane[index]
            kind, stage, mb, peer, _ = action
            if kind in compute:
                need = needs(kind)
                source = -1 if need is None else stage + need[2]
                if 0 <= source <= last and mb is not None:
                    local = rank_of(stage_ranks, source, mb) == rank
                    wanted = (need[1], source, mb) if local else (need[0], stage, mb)  # type: ignore[index]
                    if wanted not in mine:
                        raise _used_too_early(lane, rank, index, local)
                mine.add((kind, stage, mb))
            elif kind in sends:
                carried = carries(kind)
                if carried is not None and (carried, stage, mb) not in mine:
                    text = f"{carried.value}{stage}.{mb}"
                    raise ScheduleError(
                        f"rank {rank}: {action} sends before computing {text}", lane, rank, index
                    )
                pair = (rank, peer if peer is not None else -1)
                found = receives_of(kind)
                channels[pair].append(
                    targets_key if found is None else (found[0], stage + found[1], mb)
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
                        index,
                    )
                mine.add(head)
            elif kind is Kind.ALLREDUCE or kind is Kind.LOSS:
                position[rank] = index
                if not _arrive(
                    rank, action, stage_ranks, everyone, arrived, collectives, position, runnable
                ):
                    break
                index = position[rank]
                continue
            index += 1
        position[rank] = index
    _report_stuck(schedule, position, channels)


def _arrive(
    rank: int,
    action: Action,
    stage_ranks: tuple[tuple[int, ...], ...],
    everyone: tuple[int, ...],
    arrived: dict[tuple[Kind, int, int], list[int]],
    collectives: list[Counter[tuple[Kind, int]]],
    position: list[int],
    runnable: deque[int],
) -> bool:
    """``rank`` reaches a collective (an all-reduce over the stage's replicas, the loss over
    every rank); when it is the last to arrive, every member moves past it and the others
    go back on the work list. Returns whether ``rank`` moved past it."""
    kind = action.kind
    group, scope = (
        (stage_ranks[action.stage], action.stage) if kind is Kind.ALLREDUCE else (everyone, 0)
    )
    members = arrived[(kind, scope, collectives[rank][(kind, scope)])]
    if rank not in members:
        members.append(rank)
    if len(members) < len(group):
        return False
    for member in members:
        collectives[member][(kind, scope)] += 1
        position[member] += 1
        if member != rank:
            runnable.append(member)
    return True


def _used_too_early(lane: Sequence[Action], rank: int, index: int, local: bool) -> ScheduleError:
    action = lane[index]
    receive, produce, offset = NEEDS[action.kind]
    source = action.stage + offset
    what = f"{produce.value}{source}.{action.microbatch}" if local else f"its {receive.value}"
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
