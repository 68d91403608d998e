"""Schedules as text: describe() and from_text() are inverses, hand-written text is read,
and errors point at the line or the action at fault."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.schedules import Action, Kind, Schedule, ScheduleError, build, names, spec
from pipetrain.simulation import Costs, simulate


def sizes_for(name: str, ranks: int, microbatches: int) -> tuple[int, int]:
    """Sizes every family accepts: found by asking the spec, raising the count if needed."""
    while not spec(name).accepts(ranks, microbatches):
        microbatches += 1
    return ranks, microbatches


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(names()), ranks=st.integers(1, 5), microbatches=st.integers(1, 8))
def test_from_text_of_describe_gives_the_same_schedule(
    name: str, ranks: int, microbatches: int
) -> None:
    schedule = build(name, *sizes_for(name, ranks, microbatches))
    again = Schedule.from_text(schedule.describe())
    assert again == schedule
    assert again.options == schedule.options


def test_replicated_schedules_round_trip() -> None:
    schedule = build("1f1b", 3, 4, replicas=[2, 1])
    assert "placement: 0,1 2" in schedule.describe()
    assert Schedule.from_text(schedule.describe()) == schedule


def test_actions_parse_as_they_print() -> None:
    for action in [
        Action(Kind.FORWARD, 3, 5),
        Action(Kind.SEND_F, 0, 2, peer=1),
        Action(Kind.BACKWARD, 1, 0, version=2),
        Action(Kind.STEP, 4, version=1),
        Action(Kind.ALLREDUCE, 0),
        Action(Kind.LOSS, 2),
    ]:
        assert Action.parse(str(action)) == action
    with pytest.raises(ValueError, match=re.escape("'X1.0' is not an action")):
        Action.parse("X1.0")


HAND_WRITTEN = """
# GPipe on two ranks, backwards in reverse order
rank 0: F0.0 F0.1 B0.1 B0.0 STEP0
rank 1: F1.0 F1.1 B1.1 B1.0 STEP1
"""


def test_hand_written_text_gets_its_communication_and_defaults() -> None:
    schedule = Schedule.from_text(HAND_WRITTEN)
    assert (schedule.name, schedule.stages, schedule.microbatches) == ("custom", 2, 2)
    assert schedule.stage_ranks == ((0,), (1,))
    assert not schedule.split_backward and not schedule.asynchronous
    assert [str(a) for a in schedule.ranks[1]] == [
        "RECV_F1.0@0",
        "F1.0",
        "RECV_F1.1@0",
        "F1.1",
        "B1.1",
        "SEND_B1.1@0",
        "B1.0",
        "SEND_B1.0@0",
        "STEP1",
        "LOSS1",
    ]
    # by hand, F = 1 and B = 2: rank 1 runs F1.0 (1..2), F1.1 (2..3), B1.1 (3..5), B1.0
    # (5..7); rank 0 then runs B0.1 (5..7) and B0.0 (7..9)
    assert simulate(schedule, Costs(1.0, 2.0)).makespan == pytest.approx(9.0)


def test_text_errors_name_the_line() -> None:
    with pytest.raises(ScheduleError, match=re.escape("line 2: 'rank 1: F1.0 SEND_F1.0@0'")):
        Schedule.from_text("rank 0: F0.0 B0.0 STEP0\nrank 1: F1.0 SEND_F1.0@0")
    with pytest.raises(ScheduleError, match=re.escape("line 1: 'stage 0: F0.0'")):
        Schedule.from_text("stage 0: F0.0")
    with pytest.raises(ScheduleError, match="stage 0 is held by no rank"):
        Schedule.from_text("rank 0: F1.0 B1.0 STEP1")
    with pytest.raises(ScheduleError, match="got ranks \\[0, 2\\]"):
        Schedule.from_text("rank 0: F0.0 B0.0 STEP0\nrank 2: F1.0 B1.0 STEP1")


def test_a_schedule_error_lists_the_rank_with_the_failing_action_marked() -> None:
    with pytest.raises(ScheduleError) as caught:
        Schedule.from_text("rank 0: F0.0 B0.1 F0.1 B0.0 STEP0")
    message = str(caught.value)
    first, *listing = message.splitlines()
    assert first == "rank 0: B0.1 runs before its forward"
    assert listing[0] == "rank 0's actions:"
    assert [line for line in listing if "<-- here" in line] == ["       1  B0.1   <-- here"]
    assert (caught.value.rank, caught.value.index) == (0, 1)


def test_a_long_lane_is_listed_around_the_failure() -> None:
    forwards = " ".join(f"F0.{k}" for k in range(30))
    backwards = " ".join(f"B0.{k}" for k in range(30) if k != 20)
    with pytest.raises(ScheduleError) as caught:
        Schedule.from_text(f"rank 0: {forwards} {backwards} B0.20 B0.20 STEP0")
    lines = str(caught.value).splitlines()
    assert "appears 2 times" in lines[0]
    with pytest.raises(ScheduleError) as caught:
        Schedule.from_text(f"rank 0: {forwards} STEP0 {backwards} B0.20")
    lines = str(caught.value).splitlines()
    assert lines[0] == "rank 0: stage 0 steps the optimizer before B0.0"
    assert lines[2] == "  ... 23 earlier" and lines[-1] == "  ... 26 later"
