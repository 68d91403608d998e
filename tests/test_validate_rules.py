"""The validator's rules one by one, the overlapped-pair rule against a plain reading, and
mutated schedules: refused with a ScheduleError, or valid and playable."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain import Costs, simulate
from pipetrain.schedules import (
    COMPUTE_KINDS,
    Action,
    Kind,
    Schedule,
    ScheduleError,
    build,
    validate,
)
from pipetrain.schedules.overlap import check_pairs, pairs

F, B, W, STEP = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT, Kind.STEP


def plain_pairs(lane: list[Action]) -> dict[int, int]:
    """Overlapped pairs read action by action: after a marker its first compute action is a
    forward and its second a backward, a later marker starting afresh."""
    found: dict[int, int] = {}
    forward: int | None = None
    waiting = False
    for index, action in enumerate(lane):
        if action.kind is Kind.OVERLAP:
            waiting, forward = True, None
        elif waiting and action.kind in COMPUTE_KINDS:
            if forward is None and action.kind is F:
                forward = index
            else:
                if forward is not None and action.kind is B:
                    found[index] = forward
                waiting, forward = False, None
    return found


def plain_check(lane: list[Action]) -> int | None:
    """The first marker whose next compute action is not the forward of a pair on the
    marker's stage, read action by action."""
    forwards = set(plain_pairs(lane).values())
    for marker, action in enumerate(lane):
        if action.kind is Kind.OVERLAP:
            after = [i for i in range(marker + 1, len(lane)) if lane[i].kind in COMPUTE_KINDS]
            if not after or after[0] not in forwards or lane[after[0]].stage != action.stage:
                return marker
    return None


lanes = st.lists(
    st.builds(
        Action,
        st.sampled_from([Kind.OVERLAP, F, B, W, Kind.RECV_B, Kind.SEND_F, STEP]),
        st.integers(0, 1),
        st.just(0),
    ),
    max_size=14,
)


@settings(max_examples=1500, deadline=None)
@given(lane=lanes)
def test_overlapped_pairs_agree_with_a_plain_reading(lane: list[Action]) -> None:
    assert pairs(lane) == plain_pairs(lane)
    marker = plain_check(lane)
    if marker is None:
        check_pairs([lane])
    else:
        with pytest.raises(ScheduleError, match=re.escape(f"{lane[marker]} must be followed")):
            check_pairs([lane])


def parsed(text: str) -> tuple[Action, ...]:
    return tuple(Action.parse(word) for word in text.split())


def two_ranks(rank0: str, rank1: str) -> Schedule:
    return Schedule("hand", 2, 1, (parsed(rank0), parsed(rank1)), ((0,), (1,)))


def test_a_send_before_its_tensor_is_computed_is_rejected() -> None:
    with pytest.raises(ScheduleError, match=re.escape("SEND_F0.0@1 sends before computing F0.0")):
        validate(
            two_ranks(
                "SEND_F0.0@1 F0.0 RECV_B0.0@1 B0.0 STEP0",
                "RECV_F1.0@0 F1.0 B1.0 SEND_B1.0@0 STEP1",
            )
        )


def test_a_compute_before_its_local_input_is_rejected() -> None:
    # rank 0 holds stages 0 and 1: F1.0 reads F0.0's output on the same rank
    lane = parsed("F1.0 F0.0 B1.0 B0.0 STEP0 STEP1")
    with pytest.raises(ScheduleError, match=re.escape("F1.0 runs before F0.0")):
        validate(Schedule("hand", 2, 1, (lane,), ((0,), (0,))))


def test_a_message_never_received_is_rejected() -> None:
    with pytest.raises(ScheduleError, match=re.escape("which never receives it")):
        validate(
            two_ranks(
                "F0.0 SEND_F0.0@1 SEND_F0.0@1 RECV_B0.0@1 B0.0 STEP0",
                "RECV_F1.0@0 F1.0 B1.0 SEND_B1.0@0 STEP1",
            )
        )


def test_a_replicated_compute_off_its_route_is_rejected() -> None:
    lanes = (parsed("F0.1 B0.1 ALLREDUCE0 STEP0"), parsed("F0.0 B0.0 ALLREDUCE0 STEP0"))
    with pytest.raises(ScheduleError, match=re.escape("F0.1 should run on rank 1")):
        validate(Schedule("hand", 1, 2, lanes, ((0, 1),)))


def test_data_used_too_early_is_reported_only_where_the_rank_gets() -> None:
    # each rank waits for the other: rank 1 never reaches its early send
    waits_first = "F0.0 RECV_B0.0@1 SEND_F0.0@1 B0.0 STEP0"
    with pytest.raises(
        ScheduleError, match=re.escape("deadlocks: rank 0 at RECV_B0.0@1, rank 1 at RECV_F1.0@0")
    ):
        validate(two_ranks(waits_first, "RECV_F1.0@0 SEND_B1.0@0 F1.0 B1.0 STEP1"))
    # an early forward before the wait is found first
    with pytest.raises(ScheduleError, match=re.escape("F1.0 runs before its RECV_F")):
        validate(two_ranks(waits_first, "F1.0 RECV_F1.0@0 B1.0 SEND_B1.0@0 STEP1"))


small = [
    build(name, ranks, microbatches)
    for name, ranks, microbatches in [
        ("1f1b", 3, 4),
        ("zb-h1", 2, 3),
        ("interleaved", 2, 4),
        ("2bw", 2, 2),
        ("pipedream", 2, 3),
        ("zb-v", 2, 4),
        ("dualpipev", 2, 4),
    ]
]


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_a_mutated_schedule_is_refused_with_a_schedule_error_or_plays(data: st.DataObject) -> None:
    schedule = data.draw(st.sampled_from(small))
    lanes = [list(lane) for lane in schedule.ranks]
    for _ in range(data.draw(st.integers(1, 3))):
        rank = data.draw(st.integers(0, len(lanes) - 1))
        lane = lanes[rank]
        index = data.draw(st.integers(0, len(lane) - 1))
        change = data.draw(st.sampled_from(["swap", "delete", "repeat", "move", "renumber"]))
        if change == "swap" and index + 1 < len(lane):
            lane[index], lane[index + 1] = lane[index + 1], lane[index]
        elif change == "delete" and len(lane) > 1:
            del lane[index]
        elif change == "repeat":
            lane.insert(data.draw(st.integers(0, len(lane))), lane[index])
        elif change == "move":
            lanes[data.draw(st.integers(0, len(lanes) - 1))].insert(0, lane.pop(index))
        elif change == "renumber":
            lane[index] = lane[index]._replace(microbatch=data.draw(st.sampled_from([None, 0, 1])))
    mutated = replace(schedule, ranks=tuple(tuple(lane) for lane in lanes))
    try:
        validate(mutated)
    except ScheduleError:
        return
    simulate(mutated, Costs(forward_s=1.0, backward_s=2.0))
