"""The schedule validator: a schedule it rejects never reaches the simulator or the runtime.

It checks placement (each action on a rank that holds its stage), coverage (every
micro-batch of every stage forwarded and backwarded exactly once, backward after forward),
the flush of synchronous schedules, the weight-version rules of asynchronous ones, and then
executes the schedule abstractly — sends never block, a receive waits for its message, an
all-reduce for every member of its group — to find deadlocks, data used before it exists,
and channels whose messages would be matched out of order. Every check is linear in the
number of actions.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pipetrain.schedules.actions import COMPUTE_KINDS, RECV_KINDS, SEND_KINDS, Action, Kind
from pipetrain.schedules.messages import needed_by, produced_by, receive_key

if TYPE_CHECKING:
    from pipetrain.schedules.schedule import Schedule

_CONTEXT = (8, 4)  # actions shown before and after the failing one


class ScheduleError(ValueError):
    """A schedule that cannot run correctly.

    The first line names the rank and action; where one action is at fault, the rank's
    action list follows with that action marked. ``rank`` and ``index`` locate it.
    """

    def __init__(
        self,
        message: str,
        lane: Sequence[Action] | None = None,
        rank: int | None = None,
        index: int | None = None,
    ) -> None:
        """``message``, and the listing of ``lane`` (rank ``rank``'s actions) marked at ``index``."""
        if lane is not None and rank is not None and index is not None:
            message += "\n" + listing(lane, rank, index)
        super().__init__(message)
        self.rank, self.index = rank, index


def listing(lane: Sequence[Action], rank: int, index: int) -> str:
    """Rank ``rank``'s actions around ``index``, one a line, the one at ``index`` marked."""
    before, after = _CONTEXT
    start, stop = max(0, index - before), min(len(lane), index + after + 1)
    lines = [f"rank {rank}'s actions:"]
    if start:
        lines.append(f"  ... {start} earlier")
    for i in range(start, stop):
        lines.append(f"  {i:>6}  {lane[i]}" + ("   <-- here" if i == index else ""))
    if stop < len(lane):
        lines.append(f"  ... {len(lane) - stop} later")
    return "\n".join(lines)


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` if ``schedule`` could deadlock or breaks a training rule."""
    _check_placement_and_coverage(schedule)
    if schedule.asynchronous:
        _check_versions(schedule)
    else:
        _check_flush(schedule)
    _execute(schedule)


def _check_placement_and_coverage(schedule: Schedule) -> None:
    expected = {Kind.FORWARD, Kind.BACKWARD} | ({Kind.WEIGHT} if schedule.split_backward else set())
    stage_sets = [frozenset(ranks) for ranks in schedule.stage_ranks]
    stages, microbatches = schedule.stages, schedule.microbatches
    counts: Counter[tuple[Kind, int, int | None]] = Counter()
    for rank, lane in enumerate(schedule.ranks):
        seen: set[tuple[Kind, int, int | None]] = set()
        for index, action in enumerate(lane):
            kind, stage, mb = action.kind, action.stage, action.microbatch

            def fail(message: str, index: int = index) -> ScheduleError:
                return ScheduleError(f"rank {rank}: {message}", lane, rank, index)

            if not 0 <= stage < stages:
                raise fail(f"{action} names stage {stage}, outside 0..{stages - 1}")
            if rank not in stage_sets[stage]:
                held = schedule.stage_ranks[stage]
                raise fail(f"{action} belongs to stage {stage}, held by ranks {held}")
            if mb is not None and not 0 <= mb < microbatches:
                raise fail(f"{action} names micro-batch {mb} of {microbatches}")
            if kind not in COMPUTE_KINDS:
                continue
            if mb is None:
                raise fail(f"{action} names no micro-batch")
            if kind not in expected:
                raise fail(f"{action} is a {kind.value}, which this schedule does not use")
            if schedule.rank_of(stage, mb) != rank:
                raise fail(f"{action} should run on rank {schedule.rank_of(stage, mb)}")
            if kind is Kind.BACKWARD and (Kind.FORWARD, stage, mb) not in seen:
                raise fail(f"{action} runs before its forward")
            if kind is Kind.WEIGHT and (Kind.BACKWARD, stage, mb) not in seen:
                raise fail(f"{action} runs before its backward")
            key = (kind, stage, mb)
            seen.add(key)
            counts[key] += 1
    for kind in expected:
        for stage in range(stages):
            for mb in range(microbatches):
                count = counts[(kind, stage, mb)]
                if count != 1:
                    raise ScheduleError(
                        f"{kind.value} of stage {stage} micro-batch {mb} appears {count} times, "
                        "expected once"
                    )


def _check_flush(schedule: Schedule) -> None:
    """A synchronous schedule steps each stage once, after all of that rank's work on it."""
    for rank, lane in enumerate(schedule.ranks):
        steps: Counter[int] = Counter()
        for index, action in enumerate(lane):
            if action.kind is Kind.STEP:
                steps[action.stage] += 1
            elif action.kind in COMPUTE_KINDS and steps[action.stage]:
                raise ScheduleError(
                    f"rank {rank}: stage {action.stage} steps the optimizer before {action}",
                    lane,
                    rank,
                    index,
                )
        for stage in schedule.stages_of(rank):
            if steps[stage] != 1:
                raise ScheduleError(
                    f"rank {rank}: stage {stage} has {steps[stage]} optimizer steps, expected 1"
                )


def _check_versions(schedule: Schedule) -> None:
    limit = schedule.options.get("max_versions")
    max_versions = limit if isinstance(limit, int) else None
    forward_version: dict[tuple[int, int | None], int] = {}
    for rank, lane in enumerate(schedule.ranks):
        steps: dict[int, int] = defaultdict(int)
        in_use: dict[int, Counter[int]] = defaultdict(Counter)
        for index, action in enumerate(lane):

            def fail(message: str, index: int = index) -> ScheduleError:
                return ScheduleError(f"rank {rank}: {message}", lane, rank, index)

            stage, key = action.stage, (action.stage, action.microbatch)
            if action.kind is Kind.STEP:
                steps[stage] += 1
                if action.version != steps[stage]:
                    raise fail(f"{action} should produce version {steps[stage]}")
            elif action.kind is Kind.FORWARD:
                if action.version is None or action.version > steps[stage]:
                    raise fail(
                        f"{action} uses weight version {action.version}, but only "
                        f"{steps[stage]} updates have been applied"
                    )
                forward_version[key] = action.version
                in_use[stage][action.version] += 1
            elif action.kind in (Kind.BACKWARD, Kind.WEIGHT):
                if action.version != forward_version.get(key):
                    raise fail(
                        f"{action} uses version {action.version} but its forward used "
                        f"{forward_version.get(key)}"
                    )
                if action.kind is Kind.BACKWARD:
                    in_use[stage][action.version] -= 1
            if max_versions is not None and action.kind in (Kind.FORWARD, Kind.STEP):
                live = {v for v, n in in_use[stage].items() if n > 0} | {steps[stage]}
                if len(live) > max_versions:
                    raise fail(
                        f"stage {stage} needs {len(live)} weight versions at {action}, at most "
                        f"{max_versions} allowed"
                    )
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
    position = [0] * num_ranks
    done: list[set[tuple[Kind, int, int | None]]] = [set() for _ in range(num_ranks)]
    channels: dict[tuple[int, int], deque[tuple[Kind, int, int | None]]] = defaultdict(deque)
    blocked_on: dict[tuple[int, int], int] = {}  # (sender, receiver) -> receiver
    groups = [tuple(ranks) for ranks in schedule.stage_ranks]
    everyone = tuple(range(num_ranks))
    arrived: dict[tuple[Kind, int, int], list[int]] = defaultdict(list)
    collectives: list[Counter[tuple[Kind, int]]] = [Counter() for _ in range(num_ranks)]
    runnable = deque(range(num_ranks))
    while runnable:
        rank = runnable.popleft()
        lane, mine = lanes[rank], done[rank]
        index = position[rank]
        while index < len(lane):
            action = lane[index]
            kind, stage, mb = action.kind, action.stage, action.microbatch
            if kind in COMPUTE_KINDS:
                need = needed_by(action, last)
                if need is not None and mb is not None:
                    receive, produce, source = need
                    local = schedule.rank_of(source, mb) == rank
                    wanted = (produce, source, mb) if local else (receive, stage, mb)
                    if wanted not in mine:
                        what = f"{produce.value}{source}.{mb}" if local else f"its {receive.value}"
                        raise ScheduleError(
                            f"rank {rank}: {action} runs before {what}", lane, rank, index
                        )
            elif kind in SEND_KINDS:
                produced = produced_by(action)
                if produced is not None and produced not in mine:
                    text = f"{produced[0].value}{produced[1]}.{produced[2]}"
                    raise ScheduleError(
                        f"rank {rank}: {action} sends before computing {text}", lane, rank, index
                    )
                pair = (rank, action.peer if action.peer is not None else -1)
                channels[pair].append(receive_key(action, last))
                waiter = blocked_on.pop(pair, None)
                if waiter is not None:
                    runnable.append(waiter)
            elif kind in RECV_KINDS:
                pair = (action.peer if action.peer is not None else -1, rank)
                queue = channels[pair]
                if not queue:
                    blocked_on[pair] = rank
                    break
                head = queue[0]
                if head != (kind, stage, mb):
                    raise ScheduleError(
                        f"rank {rank}: {action} would be matched with {Action(*head)}, the next message "
                        f"rank {action.peer} sends on that channel",
                        lane,
                        rank,
                        index,
                    )
                queue.popleft()
            elif kind is Kind.ALLREDUCE or kind is Kind.LOSS:
                position[rank] = index
                group = groups[stage] if kind is Kind.ALLREDUCE else everyone
                scope = stage if kind is Kind.ALLREDUCE else 0
                key = (kind, scope, collectives[rank][(kind, scope)])
                members = arrived[key]
                if rank not in members:
                    members.append(rank)
                if len(members) < len(group):
                    break
                for member in members:
                    collectives[member][(kind, scope)] += 1
                    position[member] += 1
                    if member != rank:
                        runnable.append(member)
                index = position[rank]
                continue
            mine.add((kind, stage, mb))
            index += 1
        position[rank] = index
    _report_stuck(schedule, position, channels)


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
                f"rank {sender} sends {Action(*queue[0])} to rank {receiver}, which never receives it"
            )
