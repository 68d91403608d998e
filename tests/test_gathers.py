"""A sharded stage's gathers as schedule actions: placed, validated, simulated, read back."""

from __future__ import annotations

from dataclasses import replace

import pytest

import pipetrain
from pipetrain.schedules import Action, Kind, Schedule, ScheduleError, build, validate
from pipetrain.schedules.copies import data_parallel_copies
from pipetrain.schedules.gathers import with_gathers
from pipetrain.timeline import Timeline


def _replicated() -> Schedule:
    return build("1f1b", 4, 4, replicas=[2, 2])


@pytest.mark.parametrize(
    "schedule",
    [
        _replicated(),
        build("gpipe", 6, 6, replicas=[3, 2, 1]),
        data_parallel_copies(build("zb-h1", 2, 4), 2),
        data_parallel_copies(build("interleaved", 2, 4, virtual=2), 2),
        data_parallel_copies(build("zb-v", 2, 4), 2),
    ],
    ids=["1f1b", "gpipe-uneven", "zb-h1-copies", "interleaved-copies", "zb-v-copies"],
)
def test_every_replica_gathers_each_of_its_replicated_stages_first(schedule: Schedule) -> None:
    gathered = with_gathers(schedule)
    for rank, (before, after) in enumerate(zip(schedule.ranks, gathered.ranks)):
        held = [s for s, ranks in enumerate(schedule.stage_ranks) if rank in ranks]
        expected = [Action(Kind.GATHER, s) for s in held if len(schedule.stage_ranks[s]) > 1]
        assert list(after[: len(expected)]) == expected
        assert after[len(expected) :] == before
    assert with_gathers(gathered) is gathered
    assert Schedule.from_text(gathered.describe()) == gathered


def test_a_schedule_without_replicas_has_nothing_to_gather() -> None:
    schedule = build("1f1b", 3, 4)
    assert with_gathers(schedule) is schedule


def test_a_gather_after_a_pass_of_its_stage_is_refused() -> None:
    gathered = with_gathers(_replicated())
    lane = list(gathered.ranks[0])
    first_forward = next(i for i, a in enumerate(lane) if a.kind is Kind.FORWARD)
    moved = [*lane[1 : first_forward + 1], lane[0], *lane[first_forward + 1 :]]
    broken = replace(gathered, ranks=(tuple(moved), *gathered.ranks[1:]))
    with pytest.raises(ScheduleError, match="gathered before its first pass"):
        validate(broken)


def test_a_gather_one_replica_skips_never_completes() -> None:
    gathered = with_gathers(_replicated())
    skipped = replace(gathered, ranks=(gathered.ranks[0][1:], *gathered.ranks[1:]))
    with pytest.raises(ScheduleError, match="GATHER0"):
        validate(skipped)


def test_the_gather_costs_its_time_before_the_first_pass() -> None:
    # one stage on two replicas: nothing else can run while it gathers
    schedule = build("gpipe", 2, 4, replicas=[2])
    costs = pipetrain.Costs(forward_s=1.0, backward_s=2.0, step_s=0.5, allreduce_s=0.25)
    plain = pipetrain.simulate(schedule, costs)
    gathered = pipetrain.simulate(with_gathers(schedule), replace(costs, gather_s=0.75))
    assert gathered.makespan == pytest.approx(plain.makespan + 0.75)
    gathers = [e for e in gathered.events if e.kind == "GATHER"]
    assert [(e.rank, e.stage, e.start, e.end) for e in gathers] == [
        (0, 0, 0.0, 0.75),
        (1, 0, 0.0, 0.75),
    ]


def test_a_later_stages_gather_waits_only_for_its_own_replicas() -> None:
    # stage 1's replicas gather while stage 0 computes: the step grows by stage 0's gather
    schedule = with_gathers(_replicated())
    costs = pipetrain.Costs(forward_s=1.0, backward_s=2.0, gather_s=[0.5, 0.75])
    plain = pipetrain.simulate(_replicated(), replace(costs, gather_s=0.0))
    timeline: Timeline = pipetrain.simulate(schedule, costs)
    assert timeline.makespan == pytest.approx(plain.makespan + 0.5)
    by_rank = {e.rank: (e.stage, e.end) for e in timeline.events if e.kind == "GATHER"}
    assert by_rank == {0: (0, 0.5), 1: (0, 0.5), 2: (1, 0.75), 3: (1, 0.75)}
