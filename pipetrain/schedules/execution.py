"""The validator's abstract execution: every rank plays its lane with non-blocking sends, a
receive waiting for its message and a collective (an all-reduce or a gather over the stage's
replicas, the loss over every rank) for every member of its group, which finds deadlocks,
data used before it exists and channels whose messages would be matched out of order.

It visits only the actions that may wait (sends, receives, collectives), as the validator's
lane pass lists them (:class:`Lane`), so it is linear in those and in the ranks of a
collective.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter, defaultdict, deque
from typing import TYPE_CHECKING, NamedTuple

from pipetrain.schedules.actions import RECV_KINDS, SEND_KINDS, Action, Kind
from pipetrain.schedules.errors import ScheduleError
from pipetrain.schedules.messages import CARRIES, NEEDS, RECEIVES

if TYPE_CHECKING:
    from pipetrain.schedules.schedule import Schedule


class Lane(NamedTuple):
    """What the abstract execution needs of a rank's actions: the indices of its sends,
    receives and collectives (compute never waits), and the first index that uses data the
    rank does not have yet (its length if none)."""

    waits: list[int]
    early: int


def execute(schedule: Schedule, checked: list[Lane]) -> None:
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
