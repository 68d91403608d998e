"""The schedule validator: a schedule it rejects never reaches the simulator or the runtime.

It checks placement (each action on a rank that holds its stage), coverage (every
micro-batch of every stage forwarded and backwarded exactly once, backward after forward),
weight-version rules of asynchronous schedules, and executes the schedule abstractly —
sends never block, a receive waits for its message, an all-reduce for all replicas — to
find deadlocks, data used before it exists, and channels whose messages would be matched
out of order.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque

from pipetrain.schedules.actions import COMPUTE_KINDS, RECV_KINDS, Action, Kind, Schedule


class ScheduleError(ValueError):
    """A schedule that cannot run correctly: the message names the rank and action."""


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` if ``schedule`` could deadlock or breaks a training rule."""
    _check_placement(schedule)
    _check_coverage(schedule)
    if schedule.asynchronous:
        _check_versions(schedule)
    _execute(schedule)


def _check_placement(schedule: Schedule) -> None:
    for rank, actions in enumerate(schedule.ranks):
        for action in actions:
            if not 0 <= action.stage < schedule.stages:
                raise ScheduleError(
                    f"rank {rank}: {action} names stage {action.stage}, outside 0..{schedule.stages - 1}"
                )
            if rank not in schedule.stage_ranks[action.stage]:
                raise ScheduleError(
                    f"rank {rank}: {action} belongs to stage {action.stage}, held by ranks {schedule.stage_ranks[action.stage]}"
                )
            if action.microbatch is not None and action.microbatch >= schedule.microbatches:
                raise ScheduleError(
                    f"rank {rank}: {action} names micro-batch {action.microbatch} of {schedule.microbatches}"
                )
            if (
                action.kind in COMPUTE_KINDS
                and schedule.rank_of(action.stage, action.microbatch) != rank
            ):
                raise ScheduleError(
                    f"rank {rank}: {action} should run on rank {schedule.rank_of(action.stage, action.microbatch)}"
                )


def _check_coverage(schedule: Schedule) -> None:
    expected = {Kind.FORWARD, Kind.BACKWARD} | ({Kind.WEIGHT} if schedule.split_backward else set())
    counts: Counter = Counter()
    for rank, actions in enumerate(schedule.ranks):
        seen: set[tuple[Kind, int, int]] = set()
        for action in actions:
            if action.kind not in COMPUTE_KINDS:
                continue
            if action.kind not in expected:
                raise ScheduleError(
                    f"rank {rank}: {action} is a {action.kind.value}, which this schedule does not use"
                )
            key = (action.stage, action.microbatch)
            if action.kind is Kind.BACKWARD and (Kind.FORWARD, *key) not in seen:
                raise ScheduleError(f"rank {rank}: {action} runs before its forward")
            if action.kind is Kind.WEIGHT and (Kind.BACKWARD, *key) not in seen:
                raise ScheduleError(f"rank {rank}: {action} runs before its backward")
            seen.add((action.kind, *key))
            counts[(action.kind, *key)] += 1
    for stage in range(schedule.stages):
        for mb in range(schedule.microbatches):
            for kind in expected:
                if counts[(kind, stage, mb)] != 1:
                    raise ScheduleError(
                        f"{kind.value} of stage {stage} micro-batch {mb} appears {counts[(kind, stage, mb)]} times, expected once"
                    )
    if not schedule.asynchronous:
        _check_flush(schedule)


def _check_flush(schedule: Schedule) -> None:
    """A synchronous schedule steps each stage once, after all of that rank's work on it."""
    for rank, actions in enumerate(schedule.ranks):
        steps: Counter = Counter()
        for action in actions:
            if action.kind is Kind.STEP:
                steps[action.stage] += 1
            elif action.kind in COMPUTE_KINDS and steps[action.stage]:
                raise ScheduleError(
                    f"rank {rank}: stage {action.stage} steps the optimizer before {action}"
                )
        for stage in schedule.stages_of(rank):
            if steps[stage] != 1:
                raise ScheduleError(
                    f"rank {rank}: stage {stage} has {steps[stage]} optimizer steps, expected 1"
                )


def _check_versions(schedule: Schedule) -> None:
    max_versions = schedule.options.get("max_versions")
    forward_version: dict[tuple[int, int], int] = {}
    for rank, actions in enumerate(schedule.ranks):
        steps: dict[int, int] = defaultdict(int)
        in_use: dict[int, Counter] = defaultdict(Counter)
        for action in actions:
            key = (action.stage, action.microbatch)
            if action.kind is Kind.STEP:
                steps[action.stage] += 1
                if action.version != steps[action.stage]:
                    raise ScheduleError(
                        f"rank {rank}: {action} should produce version {steps[action.stage]}"
                    )
            elif action.kind is Kind.FORWARD:
                if action.version is None or action.version > steps[action.stage]:
                    raise ScheduleError(
                        f"rank {rank}: {action} uses weight version {action.version}, but only "
                        f"{steps[action.stage]} updates have been applied"
                    )
                forward_version[key] = action.version
                in_use[action.stage][action.version] += 1
            elif action.kind in (Kind.BACKWARD, Kind.WEIGHT):
                if action.version != forward_version[key]:
                    raise ScheduleError(
                        f"rank {rank}: {action} uses version {action.version} but its forward used {forward_version[key]}"
                    )
                if action.kind is Kind.BACKWARD:
                    in_use[action.stage][action.version] -= 1
            if max_versions is not None and action.kind in (Kind.FORWARD, Kind.STEP):
                live = {v for v, n in in_use[action.stage].items() if n > 0} | {steps[action.stage]}
                if len(live) > max_versions:
                    raise ScheduleError(
                        f"rank {rank}: stage {action.stage} needs {len(live)} weight versions at {action}, at most {max_versions} allowed"
                    )
    if schedule.options.get("vertical_sync"):
        for (stage, mb), version in forward_version.items():
            if version != forward_version[(0, mb)]:
                raise ScheduleError(
                    f"vertical sync: stage {stage} mini-batch {mb} uses version {version}, stage 0 used {forward_version[(0, mb)]}"
                )


def _execute(schedule: Schedule) -> None:
    """Play the schedule with non-blocking sends; raise on deadlock or misuse."""
    last_stage = schedule.stages - 1
    position = [0] * schedule.num_ranks
    done: list[set[tuple[Kind, int, int | None]]] = [set() for _ in range(schedule.num_ranks)]
    channels: dict[tuple[int, int], deque] = defaultdict(deque)
    allreduce_arrivals: dict[tuple[int, int], set[int]] = defaultdict(set)
    allreduce_count: list[Counter] = [Counter() for _ in range(schedule.num_ranks)]

    def ready(rank: int, action: Action) -> bool:
        stage, mb, mine = action.stage, action.microbatch, done[rank]
        if action.kind is Kind.FORWARD:
            if stage == 0:
                return True
            if schedule.rank_of(stage - 1, mb) == rank:
                return (Kind.FORWARD, stage - 1, mb) in mine
            return (Kind.RECV_F, stage, mb) in mine
        if action.kind is Kind.BACKWARD:
            if stage == last_stage:
                return True
            if schedule.rank_of(stage + 1, mb) == rank:
                return (Kind.BACKWARD, stage + 1, mb) in mine
            return (Kind.RECV_B, stage, mb) in mine
        if action.kind in (Kind.SEND_F, Kind.SEND_B):
            produced = Kind.FORWARD if action.kind is Kind.SEND_F else Kind.BACKWARD
            if (produced, stage, mb) not in mine:
                raise ScheduleError(
                    f"rank {rank}: {action} sends before computing {produced.value}{stage}.{mb}"
                )
            return True
        if action.kind in RECV_KINDS:
            queue = channels[(action.peer, rank)]
            if not queue:
                return False
            if queue[0] != (action.kind, stage, mb):
                kind, s, k = queue[0]
                raise ScheduleError(
                    f"rank {rank}: {action} would be matched with {kind.value}{s}.{k}, the next message rank {action.peer} sends on that channel"
                )
            return True
        if action.kind is Kind.ALLREDUCE:
            key = (stage, allreduce_count[rank][stage])
            allreduce_arrivals[key].add(rank)
            return allreduce_arrivals[key] >= set(schedule.stage_ranks[stage])
        return True  # W and STEP only need their order, checked elsewhere

    def run(rank: int, action: Action) -> None:
        position[rank] += 1
        if action.kind is Kind.SEND_F:
            channels[(rank, action.peer)].append((Kind.RECV_F, action.stage + 1, action.microbatch))
        elif action.kind is Kind.SEND_B:
            channels[(rank, action.peer)].append((Kind.RECV_B, action.stage - 1, action.microbatch))
        elif action.kind in RECV_KINDS:
            channels[(action.peer, rank)].popleft()
        elif action.kind is Kind.ALLREDUCE:
            allreduce_count[rank][action.stage] += 1
        done[rank].add((action.kind, action.stage, action.microbatch))

    progress = True
    while progress:
        progress = False
        for rank, actions in enumerate(schedule.ranks):
            while position[rank] < len(actions) and ready(rank, actions[position[rank]]):
                run(rank, actions[position[rank]])
                progress = True
    stuck = [
        (rank, schedule.ranks[rank][position[rank]])
        for rank in range(schedule.num_ranks)
        if position[rank] < len(schedule.ranks[rank])
    ]
    if stuck:
        waits = ", ".join(f"rank {rank} at {action}" for rank, action in stuck)
        raise ScheduleError(f"{schedule.name} deadlocks: {waits}")
    leftovers = [(pair, queue[0]) for pair, queue in channels.items() if queue]
    if leftovers:
        (sender, receiver), (kind, stage, mb) = leftovers[0]
        raise ScheduleError(
            f"rank {sender} sends {kind.value}{stage}.{mb} to rank {receiver}, which never receives it"
        )
