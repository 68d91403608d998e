"""RoundPipe as a schedule family: stages dealt round-robin, LOAD/OFFLOAD bracketing every
pass, the validator's residency rules, and the simulated host link."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from pipetrain.app import cli
from pipetrain.schedules import Action, Kind, Schedule, ScheduleError, build, validate
from pipetrain.simulation import Costs, simulate
from pipetrain.simulation.measured import measured_costs

HOST = (Kind.LOAD, Kind.OFFLOAD)


def _sizes() -> list[tuple[int, int, int]]:
    return [
        (ranks, stages, microbatches)
        for ranks in (2, 3, 4)
        for stages in range(ranks, 3 * ranks + 1)
        for microbatches in range(1, 9)
    ]


@pytest.mark.parametrize("resident", [1, 2])
def test_every_pass_once_on_its_round_robin_rank_between_its_load_and_offload(
    resident: int,
) -> None:
    for ranks, stages, microbatches in _sizes():
        schedule = build("roundpipe", ranks, microbatches, model_stages=stages, resident=resident)
        assert schedule.stages == stages
        found: dict[tuple[Kind, int, int | None], int] = {}
        for rank, lane in enumerate(schedule.ranks):
            held: set[int] = set()
            for action in lane:
                assert action.kind is not Kind.STEP and action.kind is not Kind.ALLREDUCE
                if action.kind is Kind.LOAD:
                    assert action.stage not in held
                    held.add(action.stage)
                    assert len(held) <= resident
                elif action.kind is Kind.OFFLOAD:
                    held.remove(action.stage)
                elif action.kind in (Kind.FORWARD, Kind.BACKWARD):
                    assert action.stage in held, (rank, action)
                    assert action.stage % ranks == rank
                    key = (action.kind, action.stage, action.microbatch)
                    found[key] = found.get(key, 0) + 1
            assert not held  # every stage's gradients returned
        expected = {
            (kind, stage, k): 1
            for kind in (Kind.FORWARD, Kind.BACKWARD)
            for stage in range(stages)
            for k in range(microbatches)
        }
        assert found == expected


def test_a_prefetch_loads_the_next_stage_before_the_current_ones_passes() -> None:
    schedule = build("roundpipe", 2, 2)  # 4 stages: rank 0 runs 0, 2 and back to 0
    written = [str(a) for a in schedule.ranks[0] if a.kind in (*HOST, Kind.FORWARD, Kind.BACKWARD)]
    assert " ".join(written) == (
        "LOAD0 LOAD2 F0.0 F0.1 OFFLOAD0 LOAD0 F2.0 F2.1 B2.0 B2.1 OFFLOAD2 B0.0 B0.1 OFFLOAD0"
    )
    once = build("roundpipe", 2, 2, resident=1)
    hosted = " ".join(str(a) for a in once.ranks[0] if a.kind in HOST)
    assert hosted == "LOAD0 OFFLOAD0 LOAD2 OFFLOAD2 LOAD0 OFFLOAD0"


def test_the_text_form_round_trips_and_reads_host_actions() -> None:
    schedule = build("roundpipe", 3, 4, model_stages=5)
    again = Schedule.from_text(schedule.describe())
    assert again == schedule and again.options == schedule.options
    assert Action.parse("LOAD3") == Action(Kind.LOAD, 3)
    assert Action.parse("OFFLOAD3") == Action(Kind.OFFLOAD, 3)
    assert str(Action(Kind.OFFLOAD, 12)) == "OFFLOAD12"


def test_sizes_it_cannot_deal_are_refused() -> None:
    with pytest.raises(ValueError, match="model_stages of at least 3"):
        build("roundpipe", 3, 4, model_stages=2)
    with pytest.raises(ValueError, match="give resident=2"):
        build("roundpipe", 3, 4, resident=3)


# the validator's residency rules --------------------------------------------------------
def _mutated(schedule: Schedule, rank: int, lane: list[Action]) -> Schedule:
    lanes = list(schedule.ranks)
    lanes[rank] = tuple(lane)
    return replace(schedule, ranks=tuple(lanes))


def _index(lane: list[Action], kind: Kind, stage: int, last: bool = False) -> int:
    found = [i for i, a in enumerate(lane) if a.kind is kind and a.stage == stage]
    return found[-1] if last else found[0]


@pytest.fixture
def schedule() -> Schedule:
    return build("roundpipe", 2, 3)


def test_a_pass_before_its_load_is_refused(schedule: Schedule) -> None:
    lane = list(schedule.ranks[0])
    load = lane.pop(_index(lane, Kind.LOAD, 0))
    lane.insert(_index(lane, Kind.FORWARD, 0) + 1, load)
    with pytest.raises(ScheduleError, match=r"rank 0: F0\.0 runs before stage 0's weights"):
        validate(_mutated(schedule, 0, lane))


def test_a_pass_after_its_offload_is_refused(schedule: Schedule) -> None:
    lane = list(schedule.ranks[0])
    offload = lane.pop(_index(lane, Kind.OFFLOAD, 0, last=True))
    lane.insert(_index(lane, Kind.BACKWARD, 0, last=True), offload)
    with pytest.raises(ScheduleError, match=r"rank 0: B0\.2 runs after OFFLOAD0 returned"):
        validate(_mutated(schedule, 0, lane))


def test_a_missing_offload_is_refused(schedule: Schedule) -> None:
    lane = list(schedule.ranks[1])
    del lane[_index(lane, Kind.OFFLOAD, 1, last=True)]
    with pytest.raises(ScheduleError, match="rank 1: stage 1 is still resident at the end"):
        validate(_mutated(schedule, 1, lane))


def test_more_resident_stages_than_the_cap_are_refused(schedule: Schedule) -> None:
    with pytest.raises(ScheduleError, match=r"rank 0: LOAD2 makes 2 stages .* resident=1"):
        validate(replace(schedule, options={**schedule.options, "resident": 1}))


def test_a_load_of_a_resident_stage_is_refused(schedule: Schedule) -> None:
    lane = [Action(Kind.LOAD, 0), *schedule.ranks[0]]
    with pytest.raises(ScheduleError, match="LOAD0 loads stage 0, resident already"):
        validate(_mutated(schedule, 0, lane))


def test_a_third_stage_over_the_cap_of_two_is_refused() -> None:
    schedule = build("roundpipe", 2, 2, model_stages=6)  # rank 0: stages 0, 2, 4
    lane = list(schedule.ranks[0])
    load = lane.pop(_index(lane, Kind.LOAD, 4))
    lane.insert(2, load)  # beside the prefetched LOAD2, before stage 0's passes
    with pytest.raises(ScheduleError, match=r"LOAD4 makes 3 stages resident at once \(0, 2, 4\)"):
        validate(_mutated(schedule, 0, lane))


@pytest.mark.parametrize("kind", [Kind.STEP, Kind.ALLREDUCE, Kind.GATHER])
def test_workers_of_a_host_store_do_not_update(schedule: Schedule, kind: Kind) -> None:
    lane = [*schedule.ranks[0][:-1], Action(kind, 0), schedule.ranks[0][-1]]
    with pytest.raises(ScheduleError, match=f"rank 0: {kind.value}0 in a schedule whose weights"):
        validate(_mutated(schedule, 0, lane))


def test_an_offload_of_a_stage_not_resident_is_refused(schedule: Schedule) -> None:
    lane = [Action(Kind.OFFLOAD, 2), *schedule.ranks[0]]
    with pytest.raises(ScheduleError, match="OFFLOAD2 returns stage 2, which is not resident"):
        validate(_mutated(schedule, 0, lane))


def test_a_hand_written_host_schedule_reads_and_a_stepping_one_does_not() -> None:
    text = "rank 0: LOAD0 F0.0 OFFLOAD0 LOAD1 F1.0 B1.0 OFFLOAD1 LOAD0 B0.0 OFFLOAD0\n"
    read = Schedule.from_text(text)
    assert [a.kind for a in read.ranks[0]].count(Kind.LOAD) == 3
    with pytest.raises(ScheduleError, match="write no STEP"):
        Schedule.from_text(text.replace("OFFLOAD0\n", "OFFLOAD0 STEP0\n"))


# simulation ------------------------------------------------------------------------------
def _longest_path(schedule: Schedule, costs: Costs) -> float:
    """The step's length as the longest path through its actions, without the engine:
    each compute after the one before it on its rank and after the pass it needs; each
    LOAD issued when its rank reaches it and after the rank's LOAD before it, each pass
    after its stage's LOAD; each gradient-carrying OFFLOAD after the one before it.
    Sends and receives cost nothing here."""
    stages = schedule.stages
    load, offload = costs.per_stage("load_s", stages), costs.per_stage("offload_s", stages)
    forward, backward = costs.per_stage("forward_s", stages), costs.per_stage("backward_s", stages)
    finished: dict[tuple[Kind, int, int], float] = {}
    position = [0] * schedule.num_ranks
    clock = [0.0] * schedule.num_ranks
    link_in, link_out = [0.0] * schedule.num_ranks, [0.0] * schedule.num_ranks
    arrived: dict[tuple[int, int], float] = {}
    gradients: set[tuple[int, int]] = set()
    end = 0.0
    progress = True
    while progress:  # sweep the ranks until none can move: a fixed point of the waits
        progress = False
        for rank, lane in enumerate(schedule.ranks):
            while position[rank] < len(lane):
                kind, stage, k, _, _ = lane[position[rank]]
                if kind in (Kind.FORWARD, Kind.BACKWARD):
                    assert k is not None
                    if kind is Kind.FORWARD:
                        need = (Kind.FORWARD, stage - 1, k) if stage > 0 else None
                    elif stage == stages - 1:
                        need = (Kind.FORWARD, stage, k)
                    else:
                        need = (Kind.BACKWARD, stage + 1, k)
                    ready = 0.0 if need is None else finished.get(need)
                    if ready is None:
                        break
                    start = max(clock[rank], arrived[(rank, stage)], ready)
                    cost = (forward if kind is Kind.FORWARD else backward)[stage]
                    clock[rank] = finished[(kind, stage, k)] = start + cost
                    if kind is Kind.BACKWARD:
                        gradients.add((rank, stage))
                elif kind is Kind.LOAD:
                    link_in[rank] = max(clock[rank], link_in[rank]) + load[stage]
                    arrived[(rank, stage)] = link_in[rank]
                elif kind is Kind.OFFLOAD and (rank, stage) in gradients:
                    gradients.discard((rank, stage))
                    link_out[rank] = max(clock[rank], link_out[rank]) + offload[stage]
                    end = max(end, link_out[rank])
                position[rank] += 1
                progress = True
    assert all(p == len(lane) for p, lane in zip(position, schedule.ranks))
    return max([end, *clock, *link_in])


@pytest.mark.parametrize(
    ("ranks", "stages", "microbatches", "resident"),
    [(2, 4, 4, 2), (3, 5, 2, 1), (3, 7, 6, 2), (4, 4, 3, 2), (2, 5, 8, 1)],
)
@pytest.mark.parametrize("host_s", [0.0, 0.7])
def test_the_makespan_is_the_longest_path(
    ranks: int, stages: int, microbatches: int, resident: int, host_s: float
) -> None:
    schedule = build("roundpipe", ranks, microbatches, model_stages=stages, resident=resident)
    costs = Costs(
        forward_s=[1.0 + 0.25 * (s % 3) for s in range(stages)],
        backward_s=[2.0 + 0.5 * (s % 2) for s in range(stages)],
        load_s=[host_s * (1 + s % 2) for s in range(stages)],
        offload_s=host_s / 2,
    )
    assert simulate(schedule, costs).makespan == pytest.approx(_longest_path(schedule, costs))


def test_a_small_case_by_hand() -> None:
    # 2 ranks, 4 stages, 4 micro-batches, F = 1, B = 2, no host transfers. Rank 0 forwards
    # stage 0 over 0..4 and stage 2 over 4..8; rank 1 stage 1 over 1..5 and stage 3 over
    # 5..9 (F3.k waits for F2.k, done at 5 + k), then B3 over 9..17; B2.k follows B3.k
    # (done at 11 + 2k) on rank 0: 11..19; rank 1 is busy until 17, so B1 runs 17..25;
    # B0.k follows B1.k (done at 19 + 2k): 19..27.
    timeline = simulate(build("roundpipe", 2, 4), Costs(forward_s=1.0, backward_s=2.0))
    assert timeline.makespan == pytest.approx(27.0)
    assert timeline.bubble_fraction == pytest.approx(1 - 2 * 24 / (2 * 27))


def test_a_prefetched_load_overlaps_the_compute_before_it() -> None:
    costs = Costs(forward_s=1.0, backward_s=2.0, load_s=3.0, offload_s=1.0)
    prefetched = simulate(build("roundpipe", 3, 6), costs)
    just_in_time = simulate(build("roundpipe", 3, 6, resident=1), costs)
    assert prefetched.makespan < just_in_time.makespan
    rank0 = prefetched.rank_events(0)
    load = next(e for e in rank0 if e.kind == "LOAD" and e.stage == 3)
    computing = [e for e in rank0 if e.kind == "F" and e.stage == 0]
    assert any(e.start < load.end and load.start < e.end for e in computing)
    first = next(e for e in rank0 if e.kind == "F" and e.stage == 3)
    assert first.start >= load.end  # the pass waits for its weights


def test_offloads_after_forwards_only_cost_nothing() -> None:
    timeline = simulate(
        build("roundpipe", 2, 2), Costs(forward_s=1.0, backward_s=1.0, offload_s=5.0)
    )
    offloads = [(e.stage, e.duration) for e in timeline.rank_events(0) if e.kind == "OFFLOAD"]
    assert offloads == [(0, 0.0), (2, 5.0), (0, 5.0)]


def test_load_and_offload_costs_are_recovered_from_a_timeline() -> None:
    schedule = build("roundpipe", 3, 4, model_stages=6)
    costs = Costs(
        forward_s=1.0, backward_s=2.0, load_s=[0.5 + s / 10 for s in range(6)], offload_s=0.25
    )
    recovered = measured_costs(simulate(schedule, costs), schedule.stages)
    assert recovered.load_s == pytest.approx(costs.load_s)
    assert recovered.offload_s == pytest.approx([0.25] * 6)


def test_roundpipe_has_less_bubble_than_1f1b_on_the_same_workers_and_compute() -> None:
    # 4 workers, 8 micro-batches; a 1F1B stage's work cut in two for RoundPipe's 8 stages
    one_f_one_b = simulate(build("1f1b", 4, 8), Costs(forward_s=1.0, backward_s=2.0))
    roundpipe = simulate(build("roundpipe", 4, 8), Costs(forward_s=0.5, backward_s=1.0))
    assert roundpipe.bubble_fraction < one_f_one_b.bubble_fraction
    assert roundpipe.makespan < one_f_one_b.makespan


# where it cannot go yet -------------------------------------------------------------------


def test_the_command_line_simulates_and_draws_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    chart = tmp_path / "roundpipe.png"
    args = ["simulate", "--schedule", "roundpipe", "--ranks", "3", "--microbatches", "6"]
    assert cli.main([*args, "--model-stages", "5", "--out", str(chart)]) == 0
    out = capsys.readouterr().out
    assert "roundpipe: 3 ranks (5 model stages), 6 micro-batches" in out
    assert chart.stat().st_size > 0


def test_lowering_wraps_from_the_last_rank_back_to_the_first() -> None:
    schedule = build("roundpipe", 3, 2, model_stages=7)  # rank 0 holds 0, 3, 6
    last, first = schedule.ranks[2], schedule.ranks[0]
    # stage 2 (rank 2) hands on to stage 3 (rank 0), and stage 3's gradient comes back
    assert Action(Kind.SEND_F, 2, 1, peer=0) in last
    assert Action(Kind.RECV_F, 3, 1, peer=2) in first
    assert Action(Kind.SEND_B, 3, 1, peer=2) in first
    assert Action(Kind.RECV_B, 2, 1, peer=0) in last
    # a receive comes after its stage's LOAD and before the pass that uses it
    receive = first.index(Action(Kind.RECV_F, 3, 0, peer=2))
    assert first.index(Action(Kind.LOAD, 3)) < receive < first.index(Action(Kind.FORWARD, 3, 0))


def test_loads_and_offloads_have_their_own_chart_styles() -> None:
    from pipetrain.timeline.gantt import COMM_STYLES, _comm_key

    assert _comm_key("LOAD") == "LOAD" and _comm_key("OFFLOAD") == "OFFLOAD"
    assert len({COMM_STYLES[kind][1] for kind in COMM_STYLES}) == len(COMM_STYLES)
