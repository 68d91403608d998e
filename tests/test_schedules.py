"""Schedules as data: every generator's output is valid, and the validator rejects bad ones."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.schedules import Action, Kind, Schedule, ScheduleError, build, names, spec, validate
from pipetrain.schedules.lower import lower

sizes = st.integers(min_value=1, max_value=7)


def compute_keys(schedule: Schedule, kind: Kind) -> list[tuple[int, int]]:
    return [
        (a.stage, a.microbatch) for actions in schedule.ranks for a in actions if a.kind is kind
    ]


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["gpipe", "1f1b", "zb-h1", "pipedream"]), stages=sizes, microbatches=sizes
)
def test_generators_cover_every_microbatch_once(name: str, stages: int, microbatches: int) -> None:
    schedule = build(name, stages, microbatches)
    expected = sorted((s, k) for s in range(stages) for k in range(microbatches))
    assert sorted(compute_keys(schedule, Kind.FORWARD)) == expected
    assert sorted(compute_keys(schedule, Kind.BACKWARD)) == expected
    assert sorted(compute_keys(schedule, Kind.WEIGHT)) == (expected if name == "zb-h1" else [])


@settings(max_examples=40, deadline=None)
@given(ranks=st.integers(1, 5), groups=st.integers(1, 3), virtual=st.integers(2, 4))
def test_interleaved_is_valid_for_multiples_of_ranks(ranks: int, groups: int, virtual: int) -> None:
    schedule = build("interleaved", ranks, ranks * groups, virtual=virtual)
    assert schedule.stages == ranks * virtual
    assert schedule.num_ranks == ranks
    for rank in range(ranks):
        assert schedule.stages_of(rank) == tuple(rank + chunk * ranks for chunk in range(virtual))


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["zb-v", "v-half", "v-min", "dualpipev", "looped-bfs", "interleaved-zb"]),
    ranks=st.integers(1, 5),
    microbatches=sizes,
)
def test_two_chunk_families_cover_every_microbatch_where_their_placement_puts_it(
    name: str, ranks: int, microbatches: int
) -> None:
    if name == "dualpipev":
        microbatches += 2 * ranks  # it needs one per model stage
    schedule = build(name, ranks, microbatches)
    stages = 2 * ranks
    expected = sorted((s, k) for s in range(stages) for k in range(microbatches))
    assert sorted(compute_keys(schedule, Kind.FORWARD)) == expected
    assert sorted(compute_keys(schedule, Kind.BACKWARD)) == expected
    split = name != "looped-bfs"
    assert sorted(compute_keys(schedule, Kind.WEIGHT)) == (expected if split else [])
    v_shaped = name.startswith(("zb-v", "v-", "dualpipev"))
    for rank in range(ranks):
        second = 2 * ranks - 1 - rank if v_shaped else rank + ranks
        assert schedule.stages_of(rank) == (rank, second)


def test_v_schedules_refuse_other_chunk_counts() -> None:
    with pytest.raises(ValueError, match="v-half places 2 chunks per rank in a V"):
        build("v-half", 2, 4, virtual=3)
    with pytest.raises(ValueError, match="dualpipev needs microbatches >= 2·ranks \\(6\\)"):
        build("dualpipev", 3, 5)


def test_an_overlapped_backward_receives_its_gradient_before_its_pair_starts() -> None:
    schedule = Schedule.from_text(
        "rank 0: F0.0 F0.1 OVERLAP0 F0.2 B0.0 B0.1 B0.2 STEP0\n"
        "rank 1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 STEP1"
    )
    lane = [str(action) for action in schedule.ranks[0]]
    pair = lane.index("OVERLAP0")
    assert lane[pair : pair + 5] == ["OVERLAP0", "RECV_B0.0@1", "F0.2", "SEND_F0.2@1", "B0.0"]
    with pytest.raises(
        ScheduleError, match="OVERLAP0 must be followed by a forward of stage 0 and then a backward"
    ):
        Schedule.from_text("rank 0: OVERLAP0 F0.0 F0.1 B0.0 B0.1 STEP0")


@settings(max_examples=40, deadline=None)
@given(
    replicas=st.lists(st.integers(1, 3), min_size=1, max_size=4),
    microbatches=sizes,
    name=st.sampled_from(["gpipe", "1f1b"]),
)
def test_replicated_stages_route_round_robin(
    replicas: list[int], microbatches: int, name: str
) -> None:
    schedule = build(name, sum(replicas), microbatches, replicas=replicas)
    assert schedule.num_ranks == sum(replicas)
    for rank, actions in enumerate(schedule.ranks):
        for action in actions:
            if action.kind is Kind.FORWARD:
                ranks = schedule.stage_ranks[action.stage]
                assert rank == ranks[action.microbatch % len(ranks)]
        allreduces = [a for a in actions if a.kind is Kind.ALLREDUCE]
        (stage,) = schedule.stages_of(rank)
        assert len(allreduces) == (1 if replicas[stage] > 1 else 0)


def test_1f1b_orders_match_the_textbook() -> None:
    schedule = build("1f1b", 4, 8)
    assert schedule.compute_order(0)[:6] == ["F0.0", "F0.1", "F0.2", "F0.3", "B0.0", "F0.4"]
    assert schedule.compute_order(3)[:4] == ["F3.0", "B3.0", "F3.1", "B3.1"]
    gpipe = build("gpipe", 2, 3)
    assert gpipe.compute_order(1) == ["F1.0", "F1.1", "F1.2", "B1.0", "B1.1", "B1.2"]


def test_sends_and_receives_connect_neighbours() -> None:
    schedule = build("1f1b", 2, 2)
    assert [str(a) for a in schedule.ranks[0]] == [
        "F0.0",
        "SEND_F0.0@1",
        "F0.1",
        "SEND_F0.1@1",
        "RECV_B0.0@1",
        "B0.0",
        "RECV_B0.1@1",
        "B0.1",
        "STEP0",
        "LOSS0",
    ]
    assert [str(a) for a in schedule.ranks[1]] == [
        "RECV_F1.0@0",
        "F1.0",
        "B1.0",
        "SEND_B1.0@0",
        "RECV_F1.1@0",
        "F1.1",
        "B1.1",
        "SEND_B1.1@0",
        "STEP1",
        "LOSS1",
    ]


@settings(max_examples=40, deadline=None)
@given(stages=sizes, microbatches=sizes, vertical_sync=st.booleans())
def test_pipedream_stashes_the_version_its_forward_used(
    stages: int, microbatches: int, vertical_sync: bool
) -> None:
    schedule = build("pipedream", stages, microbatches, vertical_sync=vertical_sync)
    forward_version = {}
    for actions in schedule.ranks:
        steps = 0
        for action in actions:
            if action.kind is Kind.STEP:
                steps += 1
            elif action.kind is Kind.FORWARD:
                # newest weights, or with vertical sync the input stage's version
                if not vertical_sync:
                    assert action.version == steps
                forward_version[(action.stage, action.microbatch)] = action.version
            elif action.kind is Kind.BACKWARD:
                assert action.version == forward_version[(action.stage, action.microbatch)]
    if vertical_sync:
        for (_stage, mb), version in forward_version.items():
            assert version == forward_version[(0, mb)]
    # every backward is followed by an update: microbatches updates per stage
    for actions in schedule.ranks:
        assert sum(a.kind is Kind.STEP for a in actions) == microbatches


@settings(max_examples=30, deadline=None)
@given(stages=st.integers(1, 5), extra=st.integers(0, 3), rounds=st.integers(1, 4))
def test_2bw_uses_one_step_stale_weights(stages: int, extra: int, rounds: int) -> None:
    per_update = stages + extra
    schedule = build("2bw", stages, per_update, rounds=rounds)
    assert schedule.microbatches == per_update * rounds
    for actions in schedule.ranks:
        assert sum(a.kind is Kind.STEP for a in actions) == rounds
        for action in actions:
            if action.kind is Kind.FORWARD:
                assert action.version == max(action.microbatch // per_update - 1, 0)


def two_rank_schedule(rank0: list[Action], rank1: list[Action], **kw) -> Schedule:
    return Schedule(
        "hand", 2, kw.pop("microbatches", 1), (tuple(rank0), tuple(rank1)), ((0,), (1,)), **kw
    )


F, B, W, STEP = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT, Kind.STEP


def test_validator_accepts_a_hand_written_schedule() -> None:
    validate(
        two_rank_schedule(
            [
                Action(F, 0, 0),
                Action(Kind.SEND_F, 0, 0, peer=1),
                Action(Kind.RECV_B, 0, 0, peer=1),
                Action(B, 0, 0),
                Action(STEP, 0),
            ],
            [
                Action(Kind.RECV_F, 1, 0, peer=0),
                Action(F, 1, 0),
                Action(B, 1, 0),
                Action(Kind.SEND_B, 1, 0, peer=0),
                Action(STEP, 1),
            ],
        )
    )


def test_validator_finds_a_deadlock() -> None:
    with pytest.raises(
        ScheduleError, match=re.escape("deadlocks: rank 0 at RECV_B0.0@1, rank 1 at RECV_F1.0@0")
    ):
        validate(
            two_rank_schedule(
                [
                    Action(F, 0, 0),
                    Action(Kind.RECV_B, 0, 0, peer=1),
                    Action(Kind.SEND_F, 0, 0, peer=1),
                    Action(B, 0, 0),
                    Action(STEP, 0),
                ],
                [
                    Action(Kind.RECV_F, 1, 0, peer=0),
                    Action(F, 1, 0),
                    Action(B, 1, 0),
                    Action(Kind.SEND_B, 1, 0, peer=0),
                    Action(STEP, 1),
                ],
            )
        )


def test_validator_rejects_backward_before_forward() -> None:
    with pytest.raises(ScheduleError, match=re.escape("B0.0 runs before its forward")):
        validate(
            Schedule("hand", 1, 1, ((Action(B, 0, 0), Action(F, 0, 0), Action(STEP, 0)),), ((0,),))
        )


def test_validator_rejects_a_missing_and_a_repeated_microbatch() -> None:
    with pytest.raises(ScheduleError, match="stage 0 micro-batch 1 appears 0 times"):
        validate(
            Schedule("hand", 1, 2, ((Action(F, 0, 0), Action(B, 0, 0), Action(STEP, 0)),), ((0,),))
        )
    with pytest.raises(ScheduleError, match="appears 2 times"):
        validate(
            Schedule(
                "hand",
                1,
                1,
                ((Action(F, 0, 0), Action(F, 0, 0), Action(B, 0, 0), Action(STEP, 0)),),
                ((0,),),
            )
        )


def test_validator_rejects_out_of_order_channels() -> None:
    rank0 = [
        Action(F, 0, 0),
        Action(Kind.SEND_F, 0, 0, peer=1),
        Action(F, 0, 1),
        Action(Kind.SEND_F, 0, 1, peer=1),
        Action(Kind.RECV_B, 0, 0, peer=1),
        Action(B, 0, 0),
        Action(Kind.RECV_B, 0, 1, peer=1),
        Action(B, 0, 1),
        Action(STEP, 0),
    ]
    rank1 = [
        Action(Kind.RECV_F, 1, 1, peer=0),
        Action(F, 1, 1),
        Action(Kind.RECV_F, 1, 0, peer=0),
        Action(F, 1, 0),
        Action(B, 1, 0),
        Action(Kind.SEND_B, 1, 0, peer=0),
        Action(B, 1, 1),
        Action(Kind.SEND_B, 1, 1, peer=0),
        Action(STEP, 1),
    ]
    with pytest.raises(ScheduleError, match=re.escape("would be matched with RECV_F1.0")):
        validate(two_rank_schedule(rank0, rank1, microbatches=2))


def test_lowering_reorders_receives_into_channel_order() -> None:
    # rank 1 consumes micro-batch 1 first; its receives still follow rank 0's send order
    orders = [
        [Action(F, 0, 0), Action(F, 0, 1), Action(B, 0, 0), Action(B, 0, 1), Action(STEP, 0)],
        [Action(F, 1, 1), Action(F, 1, 0), Action(B, 1, 0), Action(B, 1, 1), Action(STEP, 1)],
    ]
    ranks = lower(orders, [(0,), (1,)])
    assert [str(a) for a in ranks[1][:4]] == ["RECV_F1.0@0", "RECV_F1.1@0", "F1.1", "F1.0"]
    validate(Schedule("hand", 2, 2, ranks, ((0,), (1,))))


def test_validator_rejects_a_backward_on_a_different_version() -> None:
    schedule = Schedule(
        "hand",
        1,
        1,
        ((Action(F, 0, 0, version=0), Action(B, 0, 0, version=1), Action(STEP, 0, version=1)),),
        ((0,),),
        asynchronous=True,
    )
    with pytest.raises(ScheduleError, match="uses version 1 but its forward used 0"):
        validate(schedule)


def test_validator_rejects_future_weights_and_too_many_versions() -> None:
    future = Schedule(
        "hand",
        1,
        1,
        ((Action(F, 0, 0, version=1), Action(B, 0, 0, version=1), Action(STEP, 0, version=1)),),
        ((0,),),
        asynchronous=True,
    )
    with pytest.raises(ScheduleError, match="only 0 updates have been applied"):
        validate(future)
    # at the second step, micro-batches on versions 0 and 1 are in flight beside the new version 2
    actions = [
        Action(F, 0, 0, version=0),
        Action(F, 0, 1, version=0),
        Action(F, 0, 2, version=0),
        Action(B, 0, 0, version=0),
        Action(STEP, 0, version=1),
        Action(F, 0, 3, version=1),
        Action(B, 0, 1, version=0),
        Action(STEP, 0, version=2),
        Action(B, 0, 2, version=0),
        Action(STEP, 0, version=3),
        Action(B, 0, 3, version=1),
        Action(STEP, 0, version=4),
    ]
    many = Schedule(
        "hand", 1, 4, (tuple(actions),), ((0,),), asynchronous=True, options={"max_versions": 2}
    )
    with pytest.raises(ScheduleError, match="needs 3 weight versions"):
        validate(many)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: build("fancy", 2, 2), "unknown schedule 'fancy'; choose one of gpipe, 1f1b"),
        (lambda: build("1f1b", 0, 2), "ranks must be a positive integer, got 0"),
        (lambda: build("gpipe", 2, -1), "microbatches must be a positive integer, got -1"),
        (lambda: build("interleaved", 4, 6), "multiple of ranks \\(4\\), got 6"),
        (lambda: build("interleaved", 2, 2, virtual=1), "virtual must be an integer >= 2"),
        (lambda: build("2bw", 4, 2), "2bw needs microbatches >= ranks \\(4\\)"),
        (lambda: build("1f1b", 2, 2, replicas=[1]), "place 1 ranks, but ranks=2"),
    ],
)
def test_bad_arguments_name_the_value(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


@settings(max_examples=30, deadline=None)
@given(replicas=st.lists(st.integers(1, 2), min_size=1, max_size=4), pairs=st.integers(1, 4))
def test_pipedream_replicas_update_together(replicas: list[int], pairs: int) -> None:
    schedule = build("pipedream", sum(replicas), 2 * pairs, replicas=replicas)
    for ranks in schedule.stage_ranks:
        lists = [
            [a for a in schedule.ranks[rank] if a.kind in (Kind.ALLREDUCE, Kind.STEP)]
            for rank in ranks
        ]
        # every replica reduces and steps equally often: one update per replicas mini-batches
        assert all(len(steps) == len(lists[0]) for steps in lists)
        assert sum(a.kind is Kind.STEP for a in lists[0]) == 2 * pairs // len(ranks)


def test_pipedream_replicas_need_whole_rounds_and_no_vertical_sync() -> None:
    with pytest.raises(ValueError, match="multiples of every replica count"):
        build("pipedream", 3, 5, replicas=[2, 1])
    with pytest.raises(
        ValueError, match="vertical_sync needs every stage to update once per mini-batch"
    ):
        build("pipedream", 3, 4, replicas=[1, 2], vertical_sync=True)


@pytest.mark.parametrize(
    ("name", "options"), [("zb-h1", {}), ("interleaved", {"virtual": 2}), ("zb-v", {})]
)
def test_copies_of_a_pipeline_split_its_micro_batches_and_reduce_before_the_step(
    name: str, options: dict[str, int]
) -> None:
    from pipetrain.schedules.copies import data_parallel_copies

    single = build(name, 2, 4, **options)
    copied = data_parallel_copies(single, 3)
    assert copied.num_ranks == 6 and copied.microbatches == 12
    for stage, ranks in enumerate(single.stage_ranks):
        assert copied.stage_ranks[stage] == tuple(3 * ranks[0] + d for d in range(3))
    for rank, actions in enumerate(copied.ranks):
        copy, origin = rank % 3, rank // 3
        computed = [
            (a.kind, a.stage, a.microbatch)
            for a in actions
            if a.kind in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT)
        ]
        # copy d plays rank r's own work on micro-batches k·3 + d, in the same order
        expected = [
            (a.kind, a.stage, a.microbatch * 3 + copy)
            for a in single.ranks[origin]
            if a.kind in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT)
        ]
        assert computed == expected
        kinds = [a.kind for a in actions]
        for index, kind in enumerate(kinds):
            if kind is Kind.STEP:
                assert kinds[index - 1] is Kind.ALLREDUCE
    with pytest.raises(ValueError, match="updates inside the step"):
        data_parallel_copies(build("pipedream", 2, 4), 2)


BUILT_IN = [
    name for name in names() if spec(name).generate.__module__.startswith("pipetrain.schedules.")
]


@pytest.mark.parametrize("name", BUILT_IN)
def test_every_action_of_a_microbatch_holds_one_number_object(name: str) -> None:
    """Numbers from 256 up are made afresh by each addition; a family that made one per
    action would spread each micro-batch over as many objects as it has actions, and every
    pass over a large schedule would read them all (the build then slows per action as it
    grows)."""
    schedule = build(name, 4, 320)
    objects: dict[int, set[int]] = {}
    for lane in schedule.ranks:
        for action in lane:
            if action.microbatch is not None and action.microbatch >= 256:
                objects.setdefault(action.microbatch, set()).add(id(action.microbatch))
    assert objects, "no micro-batch numbered 256 or more"
    assert {number: len(ids) for number, ids in objects.items() if len(ids) > 1} == {}
