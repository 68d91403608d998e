"""The simulator reproduces the textbook bubble and memory figures and models communication."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.schedules import Schedule, build, with_targets_shipped
from pipetrain.simulation import Costs, Variation, median_makespan, simulate
from pipetrain.simulation.ports import Ports
from pipetrain.timeline import Timeline


@settings(max_examples=50, deadline=None)
@given(
    p=st.integers(1, 8), m=st.integers(1, 16), name=st.sampled_from(["gpipe", "1f1b", "pipedream"])
)
def test_fill_drain_bubble(p: int, m: int, name: str) -> None:
    timeline = simulate(build(name, p, m), Costs(forward_s=1.0, backward_s=2.0))
    assert timeline.makespan == pytest.approx(3 * (m + p - 1))
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 6), groups=st.integers(1, 4), v=st.integers(2, 4))
def test_interleaved_bubble(p: int, groups: int, v: int) -> None:
    m = p * groups
    timeline = simulate(
        build("interleaved", p, m, virtual=v), Costs(forward_s=1.0 / v, backward_s=2.0 / v)
    )
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 8), extra=st.integers(0, 16))
def test_zero_bubble_h1_has_a_third_of_1f1b_bubble(p: int, extra: int) -> None:
    m = p + extra
    costs = Costs(forward_s=1.0, backward_s=1.0, weight_s=1.0)
    zb = simulate(build("zb-h1", p, m), costs)
    one_f_one_b = simulate(build("1f1b", p, m), costs)
    assert zb.makespan == pytest.approx(3 * m + p - 1)
    assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
    assert (zb.makespan - 3 * m) * 3 == pytest.approx(one_f_one_b.makespan - 3 * m)
    # counted until each W, its deferred W's hold at least what 1F1B holds until each B
    assert all(z >= o for z, o in zip(zb.peak_activations, one_f_one_b.peak_activations))


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 8), m=st.integers(1, 16))
def test_peak_activations(p: int, m: int) -> None:
    costs = Costs(1.0, 2.0)
    assert simulate(build("gpipe", p, m), costs).peak_activations == [m] * p
    peaks = simulate(build("1f1b", p, m), costs).peak_activations
    assert peaks[0] == min(p, m)
    assert all(peak <= p for peak in peaks)


def reference_bubble_rate(timeline: Timeline, microbatches: int, chunks: int) -> float:
    """The controllable-memory paper's bubble rate, 1 − (F+B+W)·m / longest rank time, at
    F = B = W = 1 per chunk: a rank's time runs from its first pass to its last."""
    spans = []
    for rank in range(timeline.num_ranks):
        passes = [e for e in timeline.rank_events(rank) if e.kind in ("F", "B", "W")]
        spans.append(max(e.end for e in passes) - min(e.start for e in passes))
    return 1 - 3 * chunks * microbatches / max(spans)


def held_until_weight_pass(timeline: Timeline) -> list[int]:
    """Per rank, the most chunk micro-batches held at once, each from the start of its F to
    the end of its W (the weight pass still reads the stored activations)."""
    peaks = []
    for rank in range(timeline.num_ranks):
        changes = sorted(
            [(e.start, 1) for e in timeline.rank_events(rank) if e.kind == "F"]
            + [(e.end, -1) for e in timeline.rank_events(rank) if e.kind == "W"]
        )
        held = peak = 0
        for _, change in changes:
            held += change
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


V_FAMILY = [
    # name, bubble rate ~ coefficient·p/m, activation memory in micro-batches' worth
    ("zb-v", 0.0, lambda p: p),
    ("v-half", 1 / 2, lambda p: (p + 2) // 2),
    ("v-min", 2 / 3, lambda p: (p + 4) // 3),
]


@pytest.mark.parametrize("name, coefficient, memory", V_FAMILY)
@pytest.mark.parametrize("p, groups", list(itertools.product([2, 3, 4, 6, 8], [2, 4, 8])))
def test_v_schedules_reproduce_the_controllable_memory_figures(
    name: str, coefficient: float, memory: Callable[[int], int], p: int, groups: int
) -> None:
    m = groups * p
    timeline = simulate(build(name, p, m), Costs(forward_s=1.0, backward_s=1.0, weight_s=1.0))
    # a micro-batch's worth of activations on one rank is two chunk micro-batches
    assert max(held_until_weight_pass(timeline)) == 2 * memory(p)
    bubble = reference_bubble_rate(timeline, m, chunks=2)
    assert bubble <= coefficient * p / m + 1e-12
    assert bubble < (p - 1) / (m + p - 1)  # below 1F1B's, ~p/m


@pytest.mark.parametrize("p, groups", list(itertools.product([2, 4, 8], [2, 4])))
def test_zb_v_has_1f1b_memory_and_no_bubble(p: int, groups: int) -> None:
    m = groups * p
    costs = Costs(forward_s=1.0, backward_s=1.0, weight_s=1.0)
    zb_v = simulate(build("zb-v", p, m), costs)
    assert reference_bubble_rate(zb_v, m, chunks=2) == pytest.approx(0.0, abs=1e-12)
    # 1F1B's first rank holds p micro-batches of a rank's layers; ZB-V 2p chunks of half
    one_f_one_b = simulate(build("1f1b", p, m), Costs(forward_s=2.0, backward_s=4.0))
    assert max(held_until_weight_pass(zb_v)) == 2 * max(one_f_one_b.peak_activations) == 2 * p


@settings(max_examples=30, deadline=None)
@given(p=st.integers(1, 6), extra=st.integers(0, 8), v=st.integers(2, 3))
def test_looped_bfs_fills_and_drains_each_chunk_once(p: int, extra: int, v: int) -> None:
    m = p + extra
    timeline = simulate(build("looped-bfs", p, m, virtual=v), Costs(1.0 / v, 2.0 / v))
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    assert timeline.peak_activations == [v * m] * p  # every forward before any backward


@settings(max_examples=30, deadline=None)
@given(p=st.integers(1, 6), groups=st.integers(1, 4), v=st.integers(2, 3))
def test_interleaved_zero_bubble_beats_interleaved_in_its_memory(
    p: int, groups: int, v: int
) -> None:
    m = p * groups
    costs = Costs(forward_s=1.0, backward_s=1.0, weight_s=1.0)
    split = simulate(build("interleaved-zb", p, m, virtual=v), costs)
    whole = simulate(build("interleaved", p, m, virtual=v), costs)
    assert split.makespan <= whole.makespan
    held = zip(held_until_weight_pass(split), whole.peak_activations)
    assert all(mine <= theirs for mine, theirs in held)


@pytest.mark.parametrize("overlap", [0.0, 0.25, 1.0])
def test_an_overlapped_pair_lasts_the_longer_pass_and_what_it_does_not_hide(
    overlap: float,
) -> None:
    schedule = Schedule.from_text("rank 0: F0.0 OVERLAP0 F0.1 B0.0 B0.1 STEP0")
    timeline = simulate(schedule, Costs(forward_s=1.0, backward_s=3.0, overlap=overlap))
    # F0.0 alone, then F0.1 with B0.0: 3 + (1 - overlap)·1, then B0.1 alone
    assert timeline.makespan == pytest.approx(1 + 3 + (1 - overlap) + 3)
    with pytest.raises(ValueError, match=r"Costs\.overlap must be between 0 and 1"):
        simulate(schedule, Costs(1.0, 3.0, overlap=1.5))


@pytest.mark.parametrize("p, groups", [(2, 2), (2, 4), (3, 2), (4, 2), (4, 4), (8, 2)])
@pytest.mark.parametrize("overlap", [0.0, 0.5, 1.0])
def test_dualpipev_reproduces_the_dualpipe_figures(p: int, groups: int, overlap: float) -> None:
    m = groups * p
    timeline = simulate(
        build("dualpipev", p, m),
        Costs(forward_s=1.0, backward_s=1.0, weight_s=1.0, overlap=overlap),
    )
    # PP + 1 activations, PP = 2p model stages: chunk micro-batches held until their W
    assert held_until_weight_pass(timeline) == [2 * p + 1] * p
    # the DualPipe bubble (PP/2 - 1)(F&B + B - 3W) on PP/2 = p ranks, with F = 1, a full
    # backward B = 2 and F&B a forward overlapped with a full backward's input part, then W
    f_and_b = 1 + (1 - overlap) * 1 + 1
    bubble = (p - 1) * (f_and_b + 2 - 3)
    idle = [timeline.makespan - timeline.busy_time(rank) for rank in range(p)]
    assert max(idle) <= bubble + 1e-9
    if overlap == 1.0:
        assert max(idle) == pytest.approx(bubble)


def test_communication_on_the_critical_path() -> None:
    # 2 stages, 1 micro-batch: F0, send, F1, B1, send back, B0
    costs = Costs(
        forward_s=1.0, backward_s=2.0, activation_bytes=1e6, bandwidth=1e7, latency_s=0.05
    )
    timeline = simulate(build("gpipe", 2, 1), costs)
    assert timeline.makespan == pytest.approx(1 + 0.15 + 1 + 2 + 0.15 + 2)
    kinds = {e.kind for e in timeline.events}
    assert {"SEND_F", "RECV_F", "SEND_B", "RECV_B"} <= kinds


def test_each_byte_of_a_message_adds_to_its_senders_and_receivers_busy_time() -> None:
    # 2 stages, 1 micro-batch: a message of 1e6 bytes keeps its sender busy
    # 0.01 + 1e6 * 1e-8 = 0.02 s and its receiver 0.005 + 1e6 * 5e-9 = 0.01 s; the bytes
    # then cross the link (0.1 s) after the send, and the latency (0.05 s) follows them
    costs = Costs(
        forward_s=1.0, backward_s=2.0, activation_bytes=1e6, bandwidth=1e7, latency_s=0.05,
        send_s=0.01, receive_s=0.005, send_byte_s=1e-8, receive_byte_s=5e-9,
    )  # fmt: skip
    schedule = build("gpipe", 2, 1)
    shipped = replace(schedule, ranks=with_targets_shipped(schedule.ranks, schedule.stage_ranks))
    timeline = simulate(shipped, costs)
    by_kind = {e.kind: e for e in timeline.events}
    assert by_kind["SEND_F"].duration == pytest.approx(0.02)
    assert by_kind["SEND_B"].duration == pytest.approx(0.02)
    assert by_kind["RECV_F"].end - (by_kind["SEND_F"].end + 0.1 + 0.05) == pytest.approx(0.01)
    # the step's targets carry no activation bytes: only the fixed cost, first on rank 0
    assert by_kind["SEND_T"].duration == pytest.approx(0.01)
    message = 0.02 + 0.1 + 0.05 + 0.01
    assert timeline.makespan == pytest.approx(0.01 + 1 + message + 1 + 2 + message + 2)


def test_a_link_carries_one_transfer_at_a_time() -> None:
    # sends of 4 micro-batches queue on the link when transfers outlast the forward
    costs = Costs(forward_s=0.1, backward_s=0.0, activation_bytes=1.0, bandwidth=1.0)
    timeline = simulate(build("gpipe", 2, 4), costs)
    sends = [e for e in timeline.events if e.kind == "SEND_F"]
    for earlier, later in itertools.pairwise(sends):
        assert later.start >= earlier.end - 1e-12
    # 4 activations queue on the link, then 4 gradients (as large) queue on the way back
    assert timeline.makespan == pytest.approx(0.1 + 4 * 1.0 + 0.1 + 4 * 1.0)


def test_messages_sent_back_to_back_overlap_their_latencies() -> None:
    # a 0.1 s forward, 1 s of bytes a message and 0.5 s of latency: the link holds each
    # message's bytes only, so the 4th activation lands at 0.1 + 4 * 1.0 + 0.5, not after
    # four latencies queued on the link
    costs = Costs(forward_s=0.1, backward_s=0.0, activation_bytes=1.0, bandwidth=1.0, latency_s=0.5)
    timeline = simulate(build("gpipe", 2, 4), costs)
    last_forward = max(
        (e for e in timeline.events if e.kind == "F" and e.rank == 1), key=lambda e: e.start
    )
    assert last_forward.start == pytest.approx(0.1 + 4 * 1.0 + 0.5)


def test_a_rank_receives_from_its_neighbours_replicas_sharing_its_link() -> None:
    # three replicas finish a forward each at 1 s and send 2 s of bytes to the one last
    # stage: its incoming link carries all three at once, a third of its speed each, so
    # they land together at 7 s; its gradients leave one after another (GPipe's
    # backwards, of no cost, all follow the last forward at 10 s: they land at 12, 14, 16 s)
    costs = Costs(forward_s=1.0, backward_s=0.0, activation_bytes=2.0, bandwidth=1.0, step_s=0.0)
    timeline = simulate(build("gpipe", 4, 3, replicas=[3, 1]), costs)
    forwards = sorted(e.start for e in timeline.rank_events(3) if e.kind == "F")
    assert forwards == pytest.approx([7.0, 8.0, 9.0])
    received = sorted(e.end for e in timeline.events if e.kind == "RECV_B")
    assert received == pytest.approx([12.0, 14.0, 16.0])
    # one link per sender-receiver pair would have landed all three at 3 s
    assert timeline.makespan == pytest.approx(16.0)


def test_an_incoming_link_is_shared_among_the_messages_crossing_it() -> None:
    ports = Ports(5)
    ports.carry(0, 4, ready=0.0, wire_s=2.0, key="a")
    ports.carry(1, 4, ready=6.0, wire_s=1.0, key="b")
    # played later but ready earlier: alone 1-2 s, then half the link with "a"
    ports.carry(2, 4, ready=1.0, wire_s=2.0, key="c")
    assert ports.take("a") == pytest.approx(3.0)  # 1 s alone, then 1 s at half speed
    # "a" is taken: a message added now cannot move it
    ports.carry(3, 4, ready=0.0, wire_s=0.5, key="d")
    assert ports.take("d") == pytest.approx(1.0)  # shares 0-1 s with "a"
    # "d" took half the link from "a" until 1 s; "c" then shares it with "a" (still
    # crossing by the new count, until 4 s, though its taker keeps 3 s), then runs alone
    assert ports.take("c") == pytest.approx(4.5)
    assert ports.take("b") == pytest.approx(7.0)
    assert ports.take("a") is None  # taken once
    # a sender's outgoing link: its next message leaves after its last, to any receiver
    ports.carry(3, 0, ready=0.0, wire_s=1.0, key="e")
    assert ports.take("e") == pytest.approx(1.5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 4.0), st.floats(0.05, 2.0)), min_size=1, max_size=6))
def test_sharing_matches_a_link_stepped_in_small_ticks(flows: list[tuple[float, float]]) -> None:
    ports = Ports(len(flows) + 1)
    for sender, (ready, wire) in enumerate(flows):
        ports.carry(sender, len(flows), ready, wire, key=sender)
    found = [ports.take(sender) for sender in range(len(flows))]
    # reference: every tick, the link's speed split equally among the unfinished messages
    tick, now = 1e-4, 0.0
    left = [wire for _, wire in flows]
    done = [math.inf] * len(flows)
    while any(math.isinf(d) for d in done):
        crossing = [i for i, (ready, _) in enumerate(flows) if ready <= now and math.isinf(done[i])]
        for i in crossing:
            left[i] -= tick / len(crossing)
            if left[i] <= 0:
                done[i] = now + tick
        now += tick
    assert found == pytest.approx(done, abs=10 * len(flows) * tick)  # a tick per event


def test_replicated_stage_allreduce_waits_for_all_replicas() -> None:
    schedule = build("1f1b", 3, 4, replicas=[2, 1])
    timeline = simulate(
        schedule, Costs(forward_s=[2.0, 1.0], backward_s=[2.0, 1.0], allreduce_s=[0.5, 0.0])
    )
    allreduces = [e for e in timeline.events if e.kind == "ALLREDUCE"]
    assert {e.rank for e in allreduces} == {0, 1}
    assert allreduces[0].start == allreduces[1].start


def test_uneven_stage_costs_follow_the_slowest_stage() -> None:
    p, m = 3, 12
    costs = Costs(forward_s=[1.0, 3.0, 1.0], backward_s=[2.0, 6.0, 2.0])
    timeline = simulate(build("1f1b", p, m), costs)
    # the 9 s stage runs back to back after stage 0's first forward (1 s) and before
    # stage 0's last backward (2 s); stage 2's work hides behind the in-flight micro-batch
    assert timeline.makespan == pytest.approx(1 + m * 9 + 2)


def test_costs_are_checked() -> None:
    schedule = build("1f1b", 2, 2)
    with pytest.raises(ValueError, match="forward_s has 3 values, expected 2"):
        simulate(schedule, Costs(forward_s=[1, 1, 1], backward_s=1))
    with pytest.raises(ValueError, match="non-negative"):
        simulate(schedule, Costs(forward_s=-1, backward_s=1))
    with pytest.raises(ValueError, match="send_byte_s must be a non-negative"):
        simulate(schedule, Costs(forward_s=1, backward_s=1, send_byte_s=-1e-9))
    assert math.isinf(Costs(1, 1).bandwidth)


# ---- run-to-run variation ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_a_fixed_factor_scales_every_compute_action(name: str) -> None:
    schedule = build(name, 3, 4)
    costs = Costs(
        forward_s=[1.0, 2.0, 1.5],
        backward_s=[2.0, 1.0, 3.0],
        weight_s=[0.5, 1.0, 0.25],
        latency_s=0.1,
    )
    doubled = Costs(
        forward_s=[2.0, 4.0, 3.0],
        backward_s=[4.0, 2.0, 6.0],
        weight_s=[1.0, 2.0, 0.5],
        latency_s=0.1,
    )
    assert simulate(schedule, costs, Variation([[1.0]] * 3, [[1.0]] * 3)).makespan == pytest.approx(
        simulate(schedule, costs).makespan
    )
    twice = Variation([[2.0]] * 3, [[2.0]] * 3)
    assert simulate(schedule, costs, twice).makespan == pytest.approx(
        simulate(schedule, doubled).makespan
    )
    assert median_makespan(schedule, costs, twice, runs=3) == pytest.approx(
        simulate(schedule, doubled).makespan
    )


def test_one_slow_action_on_a_one_rank_pipeline_adds_its_extra_time() -> None:
    # one rank runs its 4 forwards and 4 backwards back to back: the makespan is their sum,
    # each forward 1 s times a draw from {1, 3}
    schedule = build("gpipe", 1, 4)
    costs = Costs(forward_s=1.0, backward_s=2.0)
    variation = Variation([[1.0, 3.0]], [[1.0]])
    for seed in range(10):
        timeline = simulate(schedule, costs, variation, seed)
        forwards = [e.duration for e in timeline.events if e.kind == "F"]
        assert set(forwards) <= {1.0, 3.0}
        assert timeline.makespan == pytest.approx(sum(forwards) + 4 * 2.0)
    assert simulate(schedule, costs, variation, 7) == simulate(schedule, costs, variation, 7)


def test_the_median_step_exceeds_the_step_of_median_actions() -> None:
    # rank 1's forward waits for rank 0's, so the step is the sum of two forwards, each 1 s
    # times a draw from {1, 1, 3}: 2 s with probability 4/9 and otherwise 4 s or 6 s. Every
    # action's median is 1 s, but the median step is 4 s.
    schedule = build("gpipe", 2, 1)
    costs = Costs(forward_s=1.0, backward_s=0.0)
    variation = Variation([[1.0, 1.0, 3.0], [1.0, 1.0, 3.0]], [[1.0], [1.0]])
    makespans = [simulate(schedule, costs, variation, seed).makespan for seed in range(401)]
    assert set(round(m, 9) for m in makespans) == {2.0, 4.0, 6.0}
    assert 0.35 < sum(m == pytest.approx(2.0) for m in makespans) / len(makespans) < 0.55
    assert simulate(schedule, costs).makespan == pytest.approx(2.0)
    assert median_makespan(schedule, costs, variation, runs=401) == pytest.approx(4.0)


def test_variation_is_checked() -> None:
    schedule = build("1f1b", 2, 2)
    with pytest.raises(ValueError, match="each of the 2 stages"):
        simulate(schedule, Costs(1, 1), Variation([[1.0]], [[1.0], [1.0]]))
    with pytest.raises(ValueError, match="non-negative factors"):
        simulate(schedule, Costs(1, 1), Variation([[1.0], []], [[1.0], [1.0]]))
    with pytest.raises(ValueError, match="runs must be a positive integer"):
        median_makespan(schedule, Costs(1, 1), Variation([[1.0]] * 2, [[1.0]] * 2), runs=0)


def test_micro_batches_of_their_own_sizes_cost_their_own_times() -> None:
    alone = build("gpipe", 1, 3)
    scaled = Costs(forward_s=1.0, backward_s=2.0, compute_scale=[1.0, 0.5, 3.0])
    assert simulate(alone, scaled).makespan == pytest.approx(3 * (1.0 + 0.5 + 3.0))
    # every micro-batch twice as costly, compute and bytes: as if every cost doubled
    pipeline = build("1f1b", 4, 8)
    base = dict(forward_s=[1.0, 2.0, 1.5, 1.0], backward_s=2.0, activation_bytes=100.0)
    doubled = Costs(
        **base, bandwidth=50.0, send_byte_s=0.001, compute_scale=[2.0] * 8, bytes_scale=[2.0] * 8
    )
    by_hand = Costs(
        forward_s=[2.0, 4.0, 3.0, 2.0], backward_s=4.0, activation_bytes=200.0, bandwidth=50.0,
        send_byte_s=0.001,
    )  # fmt: skip
    assert simulate(pipeline, doubled).makespan == pytest.approx(
        simulate(pipeline, by_hand).makespan
    )
    with pytest.raises(ValueError, match="compute_scale has 2 micro-batches"):
        simulate(pipeline, Costs(forward_s=1.0, backward_s=1.0, compute_scale=[1.0, 1.0]))
