"""The planner picks the fastest configuration that fits, with hand-checkable predictions."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from planning_cases import VGG16_CONVOLUTIONS, resnet_like_profile, vgg16_profile

from pipetrain.planning import Plan, PlanStage, StageFootprint, Topology, plan, worker_memory
from pipetrain.planning.memory import in_flight
from pipetrain.planning.planner import FEWER_WITHIN
from pipetrain.profiler import LayerCost, Profile, Spread
from pipetrain.schedules import build
from pipetrain.simulation import Costs, simulate


def uniform(layers: int, forward: float = 1.0, backward: float = 2.0, **sizes: float) -> Profile:
    """``layers`` identical layers."""
    return Profile(
        [LayerCost(forward_s=forward, backward_s=backward, **sizes) for _ in range(layers)]
    )


# ---- memory model -------------------------------------------------------------------------

TWO_LAYERS = Profile(
    [
        LayerCost(1.0, 2.0, activation_bytes=10, parameter_bytes=100, optimizer_bytes=200),
        LayerCost(1.0, 2.0, activation_bytes=20, parameter_bytes=50, optimizer_bytes=100),
    ],
    input_bytes=5,
)
FIRST = StageFootprint.of(TWO_LAYERS, 0, 1)
SECOND = StageFootprint.of(TWO_LAYERS, 1, 2)


def test_footprint_holds_the_stage_input_and_every_output() -> None:
    # weights, optimizer, kept, input, largest layer, output sent, input gradient sent
    first = (100, 200, 15, 5, 10, 10, 0)
    second = (50, 100, 30, 10, 20, 0, 10)
    for footprint, expected in ((FIRST, first), (SECOND, second)):
        assert (
            footprint.parameter_bytes,
            footprint.optimizer_bytes,
            footprint.activation_bytes,
            footprint.input_bytes,
            footprint.workspace_bytes,
            footprint.output_bytes,
            footprint.gradient_bytes,
        ) == expected


def test_footprint_counts_what_layers_save_where_it_was_profiled() -> None:
    saving = Profile(
        [
            LayerCost(1.0, 2.0, activation_bytes=10, saved_bytes=70, parameter_bytes=100),
            LayerCost(1.0, 2.0, activation_bytes=20, saved_bytes=40, parameter_bytes=50),
        ],
        input_bytes=5,
    )
    both = StageFootprint.of(saving, 0, 2)
    assert (both.activation_bytes, both.input_bytes, both.workspace_bytes) == (5 + 70 + 40, 5, 70)
    # the second stage's input is the first layer's output, not what that layer saved
    assert StageFootprint.of(saving, 1, 2).activation_bytes == 10 + 40


@pytest.mark.parametrize(
    ("schedule", "stage", "microbatches", "replicas", "recompute", "expected"),
    [
        # weights + gradients + optimizer = 400 (stage 0) or 200 (stage 1), then activations,
        # then the workspace of the stage's largest layer: 10 (stage 0) or 20 (stage 1),
        # then the messages sent by the peak: every output (10 each, stage 0) and the input
        # gradient (10 each, stage 1) of every micro-batch of the window not still held
        ("gpipe", 0, 4, [1, 1], False, 400 + 4 * 15 + 10 + 4 * 10),
        ("gpipe", 0, 4, [1, 1], True, 400 + 4 * 5 + 15 + 10 + 4 * 10),
        ("1f1b", 0, 4, [1, 1], False, 400 + 2 * 15 + 10 + 4 * 10),
        ("1f1b", 1, 4, [1, 1], False, 200 + 1 * 30 + 20 + (4 - 1) * 10),
        # zb-h1 on 2 ranks, rank 0: F0 F1 B0 F2 B1 F3 B2 W0 B3 W1 W2 W3 holds all 4 until
        # their W, 3 of them re-materialised between B and W
        ("zb-h1", 0, 4, [1, 1], True, 400 + 4 * 5 + 3 * 15 + 10 + 4 * 10),
        ("zb-h1", 0, 4, [1, 1], False, 400 + 4 * 15 + 10 + 4 * 10),
        # pipedream's update after every backward frees its gradients: no gradient buffer
        ("pipedream", 0, 4, [1, 1], False, 2 * 100 + 200 + 2 * 15 + 10 + 4 * 10),
        # 2bw's step plays two updates: 8 micro-batches, 7 of whose gradients are sent
        ("2bw", 1, 4, [1, 1], False, 2 * 50 + 50 + 100 + 30 + 20 + (8 - 1) * 10),
        # 2 replicas: each plays 2 of the 4 micro-batches; at the all-reduce the gradients'
        # flat copy joins weights, gradients and optimizer state (3 * 100 + 200), higher here
        # than the activations' moment (400 + 2 * 15 + 10)
        ("gpipe", 0, 4, [2, 1], False, 3 * 100 + 200 + 2 * 10),
        ("1f1b", 0, 8, [2, 1], False, 3 * 100 + 200 + 4 * 10),
        ("1f1b", 0, 1, [1, 1], False, 400 + 15 + 10 + 10),
    ],
)
def test_worker_memory_by_hand(
    schedule: str,
    stage: int,
    microbatches: int,
    replicas: list[int],
    recompute: bool,
    expected: float,
) -> None:
    footprint = [FIRST, SECOND][stage]
    assert (
        worker_memory([footprint], [recompute], schedule, stage, microbatches, replicas) == expected
    )


def test_interleaved_memory_by_hand() -> None:
    # Rank 0 of 2 holds two chunks; Megatron's warm-up keeps (2-0-1)*2 + (2-1)*2 + 1 = 5
    # chunk micro-batches.
    both = [FIRST, SECOND]
    # the workspace is the larger chunk's largest layer: 20; sent by the peak: the first
    # chunk's 4 outputs and, of the 8 chunk micro-batches' gradients less the 5 held, 1.5
    # per chunk from the second
    sent = 4 * 10 + 1.5 * 10
    assert (
        worker_memory(both, [False, False], "interleaved", 0, 4, [1, 1])
        == 600 + 5 * (15 + 30) / 2 + 20 + sent
    )
    assert (
        worker_memory(both, [True, False], "interleaved", 0, 4, [1, 1])
        == 600 + 5 * (5 + 30) / 2 + 15 + 20 + sent
    )


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved", "pipedream"]),
    stages=st.integers(1, 5),
    groups=st.integers(1, 4),
)
def test_in_flight_counts_match_the_simulated_peaks(name: str, stages: int, groups: int) -> None:
    microbatches = stages * groups
    virtual = 2 if name == "interleaved" else 1
    timeline = simulate(build(name, stages, microbatches), Costs(1.0, 1.0, weight_s=1.0))
    expected = [
        in_flight(name, rank, microbatches, [1] * stages, virtual) for rank in range(stages)
    ]
    assert timeline.peak_activations == expected


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["zb-v", "v-half", "v-min", "dualpipev", "interleaved-zb"]),
    ranks=st.integers(1, 5),
    microbatches=st.integers(1, 12),
)
def test_split_backward_chunks_are_held_until_their_weight_pass(
    name: str, ranks: int, microbatches: int
) -> None:
    if name == "dualpipev":
        microbatches += 2 * ranks  # one per model stage at least
    timeline = simulate(build(name, ranks, microbatches), Costs(1.0, 1.0, weight_s=1.0))
    held = []  # per rank, the most chunk micro-batches between an F's start and its W's end
    for rank in range(ranks):
        changes = sorted(
            [(e.start, 1) for e in timeline.rank_events(rank) if e.kind == "F"]
            + [(e.end, -1) for e in timeline.rank_events(rank) if e.kind == "W"]
        )
        count = peak = 0
        for _, change in changes:
            count += change
            peak = max(peak, count)
        held.append(peak)
    assert held == [in_flight(name, rank, microbatches, [1] * ranks, 2) for rank in range(ranks)]


@settings(max_examples=30, deadline=None)
@given(replicas=st.lists(st.integers(1, 3), min_size=1, max_size=3), microbatches=st.integers(1, 9))
def test_replicated_in_flight_counts_match_the_simulated_peaks(
    replicas: list[int], microbatches: int
) -> None:
    for name in ("gpipe", "1f1b"):
        peaks = simulate(
            build(name, sum(replicas), microbatches, replicas=replicas), Costs(1.0, 1.0)
        ).peak_activations
        first = 0
        for stage, count in enumerate(replicas):
            assert max(peaks[first : first + count]) == in_flight(
                name, stage, microbatches, replicas
            )
            first += count


# ---- choosing a plan ----------------------------------------------------------------------


def test_straight_1f1b_step_time_is_the_textbook_formula() -> None:
    chosen = plan(uniform(4), workers=4, schedules=("1f1b",), microbatches=(8,), replication=False)
    assert chosen.balance == [1, 1, 1, 1] and chosen.replicas == [1, 1, 1, 1]
    assert chosen.predicted_step_s == pytest.approx(3 * (8 + 4 - 1))
    assert chosen.predicted_throughput == pytest.approx(8 / 33)


def test_zero_bubble_wins_when_the_weight_gradient_can_be_deferred() -> None:
    profile = Profile(
        [LayerCost(forward_s=1.0, backward_s=2.0, weight_backward_s=1.0) for _ in range(4)]
    )
    chosen = plan(profile, workers=4, microbatches=(8,), replication=False)
    assert chosen.schedule == "zb-h1"
    assert chosen.predicted_step_s == pytest.approx(3 * 8 + 4 - 1)


def test_interleaving_wins_with_few_microbatches() -> None:
    chosen = plan(
        uniform(8),
        workers=4,
        schedules=("1f1b", "interleaved"),
        microbatches=(4,),
        replication=False,
    )
    assert (chosen.schedule, chosen.virtual, chosen.ranks) == ("interleaved", 2, 4)
    assert chosen.balance == [1] * 8
    # bubble (p - 1) / (v·m + p - 1) with chunks of F = 1, B = 2
    assert chosen.predicted_step_s == pytest.approx(3 * (2 * 4 + 4 - 1))


def test_vgg16_on_4x4_gpus_plans_15_1() -> None:
    """PipeDream's VGG-16 result: convolutions on 15 GPUs, the classifier on one."""
    profile = vgg16_profile()
    chosen = plan(profile, topology="4x16GB/s,4x10Gbit/s", batch_size=1024)
    assert chosen.balance == [VGG16_CONVOLUTIONS, 3]
    assert chosen.replicas == [15, 1]
    weights = sum(layer.parameter_bytes for layer in profile.layers)
    compute = sum(layer.compute_s for layer in profile.layers) * 1024 / 64 / 16
    data_parallel_step = compute + 2 * 15 / 16 * weights / 1.25e9
    assert chosen.predicted_throughput > 2 * 1024 / data_parallel_step


def test_small_weights_on_one_fast_level_give_data_parallelism() -> None:
    chosen = plan(resnet_like_profile(), topology="8x300GB/s")
    assert chosen.balance == [50] and chosen.replicas == [8]


def test_predicted_step_is_the_simulated_makespan() -> None:
    profile = uniform(6, activation_bytes=1e6, parameter_bytes=1e6)
    chosen = plan(
        profile,
        topology="2x1GB/s,2x0.1GB/s",
        schedules=("gpipe",),
        microbatches=(4,),
        replication=False,
    )
    assert chosen.balance == [2, 2, 1, 1]  # the least bottleneck, earlier stages fuller
    layer = profile.layers[0]
    bounds = [(s.start, s.stop) for s in chosen.stages]
    costs = Costs(
        forward_s=[layer.forward_s * (stop - start) for start, stop in bounds],
        backward_s=[layer.backward_s / 2 * (stop - start) for start, stop in bounds],
        weight_s=[layer.backward_s / 2 * (stop - start) for start, stop in bounds],
        activation_bytes=1e6,
        bandwidth=[1e9, 1e8, 1e9],
    )
    makespan = simulate(build("gpipe", 4, 4), costs).makespan
    assert chosen.predicted_step_s == pytest.approx(makespan)


def test_fewer_micro_batches_win_within_a_few_percent_of_the_fastest() -> None:
    # two stages of 1F1B over a batch of 64: 8 micro-batches step in 432 s, 16 in 408
    # (5.9% faster than 8), 32 in 396 (3% faster than 16, within FEWER_WITHIN)
    profile = uniform(4)

    def step_s(counts: tuple[int, ...]) -> float:
        chosen = plan(
            profile, workers=2, schedules=("1f1b",), microbatches=counts, batch_size=64,
            replication=False,
        )  # fmt: skip
        return chosen.predicted_step_s

    steps = [step_s((m,)) for m in (8, 16, 32)]
    assert steps == pytest.approx([432.0, 408.0, 396.0])
    # 32 is faster than 16 by less than FEWER_WITHIN, 16 than 8 by more
    assert steps[1] / steps[2] - 1 < FEWER_WITHIN < steps[0] / steps[1] - 1
    chosen = plan(
        profile, workers=2, schedules=("1f1b",), microbatches=(8, 16, 32), batch_size=64,
        replication=False,
    )  # fmt: skip
    assert chosen.microbatches == 16


def test_fewer_stages_win_within_a_few_percent_of_the_fastest() -> None:
    # on 2 workers over 1 B/s links: the two-stage 1F1B pipeline steps in 432 s; data
    # parallelism in 384 s plus the all-reduce of 4 layers' 15 bytes, 444 s (2.8% slower)
    profile, topology = uniform(4, parameter_bytes=15), Topology.flat(2, 1.0)

    def chosen(replication: bool) -> Plan:
        return plan(
            profile, topology=topology, schedules=("1f1b",), microbatches=(8,),
            batch_size=64, replication=replication,
        )  # fmt: skip

    straight, preferred = chosen(replication=False), chosen(replication=True)
    assert straight.replicas == [1, 1] and preferred.replicas == [2]
    assert straight.predicted_step_s == pytest.approx(432.0)
    assert preferred.predicted_step_s == pytest.approx(444.0)
    assert 1 < preferred.predicted_step_s / straight.predicted_step_s < 1 / (1 - FEWER_WITHIN)


def test_the_step_ends_with_the_loss_all_reduce() -> None:
    # one worker runs 4 micro-batches of 1 + 2 s back to back, then the loss is all-reduced
    profile = Profile(uniform(3).layers, message_s=0.5)
    chosen = plan(profile, workers=1, schedules=("1f1b",), microbatches=(4,))
    assert chosen.predicted_step_s == chosen.steady_step_s == pytest.approx(4 * 3 * (1 + 2) + 0.5)


def test_measured_runs_stretch_the_prediction() -> None:
    # every measured run took twice the median: every action does, and so does the step
    layers = uniform(6).layers
    slow_runs = Spread(
        [[2 * layer.forward_s for layer in layers]] * 3,
        [[2 * layer.backward_s for layer in layers]] * 3,
    )
    steady = plan(Profile(layers), workers=3, schedules=("1f1b",), microbatches=(4,))
    varied = plan(
        Profile(layers, spread=slow_runs), workers=3, schedules=("1f1b",), microbatches=(4,)
    )
    assert varied.balance == steady.balance and varied.steady_step_s == pytest.approx(
        steady.predicted_step_s
    )
    assert varied.predicted_step_s == pytest.approx(2 * steady.predicted_step_s)
    assert varied.predicted_throughput == pytest.approx(steady.predicted_throughput / 2)
    assert "with every action at its median time" in varied.describe()


# ---- memory limits ------------------------------------------------------------------------


def heavy_activations() -> Profile:
    return uniform(8, activation_bytes=1e9, parameter_bytes=1e8, optimizer_bytes=2e8)


def deep_zero_bubble_profile() -> Profile:
    """32 layers with F = B = W = 1 s, each keeping 1 kB for its backward, with outputs too
    small to count (so no message adds memory), 40 B of weights, gradients and optimizer
    state."""
    layer = LayerCost(
        forward_s=1.0,
        backward_s=2.0,
        weight_backward_s=1.0,
        saved_bytes=1000,
        parameter_bytes=10,
        optimizer_bytes=20,
    )
    return Profile([layer] * 32)


def test_under_a_memory_limit_that_1f1b_exceeds_a_v_schedule_is_chosen() -> None:
    profile = deep_zero_bubble_profile()

    def planned(limit: float | None) -> Plan:
        return plan(profile, workers=4, microbatches=(16,), replication=False, memory_limit=limit)

    # by hand, on 4 workers: weights, gradients and optimizer state of 8 layers, 320 B; a
    # stage or chunk keeps 1 kB a layer for each micro-batch it holds. 1F1B's first worker
    # holds 4 micro-batches of 8 layers: 4·8 kB; ZB-V 2·4 chunk micro-batches of 4 layers:
    # 8·4 kB; V-Half 2·(4 + 2)//2 of them: 6·4 kB; V-Min 2·(4 + 4)//3: 4·4 kB; and every
    # worker the workspace of one layer, 1 kB
    one_f_one_b, zb_v, v_half, v_min = (1320 + n for n in (32_000, 32_000, 24_000, 16_000))
    zb_v_alone = plan(
        profile, workers=4, microbatches=(16,), replication=False, schedules=("zb-v",)
    )
    assert (zb_v_alone.schedule, zb_v_alone.virtual, zb_v_alone.recompute) == ("zb-v", 2, "never")
    assert max(zb_v_alone.stage_memory_bytes) == zb_v
    # the bubble of ZB-V is 0 at F = B = W: each rank computes 16·8·3 s, and the last starts
    # after 3 chunk forwards of 4 s
    assert zb_v_alone.predicted_step_s == pytest.approx(16 * 8 * 3 + 3 * 4)
    # free to choose, the planner takes ZB-H1's 4 stages, 3% slower, over ZB-V's 8 chunks
    free = planned(None)
    assert (free.schedule, free.virtual) == ("zb-h1", 1)
    assert free.predicted_step_s == pytest.approx(408.0)
    assert "is as fast or within a few percent, with fewer stages" in free.rejected["zb-v"]

    under_1f1b = planned(33_000)
    assert one_f_one_b > 33_000 > v_half
    assert (under_1f1b.schedule, under_1f1b.recompute) == ("v-half", "never")
    assert max(under_1f1b.stage_memory_bytes) == v_half
    rejected = under_1f1b.rejected
    assert set(rejected) == {
        "gpipe", "1f1b", "interleaved", "zb-h1", "looped-bfs", "interleaved-zb", "zb-v", "v-min",
        "dualpipev", "roundpipe",
    }  # fmt: skip
    assert rejected["1f1b"].startswith(
        "over the memory limit of 33 kB with recomputation never (33.32 kB on a worker); "
        "fits with recomputation except_last"
    )
    # re-materialising saves zb-v little: what a B re-materialises stays until its W, and
    # at unit costs 7 of its chunk micro-batches wait between the two at once: 7·4 kB
    assert rejected["zb-v"].startswith(
        "over the memory limit of 33 kB with recomputation never (33.32 kB on a worker); "
        "fits with recomputation except_last (29.32 kB on a worker)"
    )
    assert re.fullmatch(
        r"fits with recomputation never \(17.32 kB on a worker\) but is slower: \S+ samples/s "
        "steady at best",
        rejected["v-min"],
    )
    text = under_1f1b.describe()
    assert text.startswith("v-half: 8 stages on 4 ranks, 2 chunks per rank")
    assert "rejected:\n  gpipe: " in text and f"  1f1b: {rejected['1f1b']}" in text

    under_v_half = planned(25_000)
    assert v_half > 25_000 > v_min
    assert (under_v_half.schedule, under_v_half.recompute) == ("v-min", "never")
    assert max(under_v_half.stage_memory_bytes) == v_min
    assert under_v_half.rejected["v-half"].startswith(
        "over the memory limit of 25 kB: needs at least 25.32 kB on a worker"
    )
    assert under_v_half.predicted_step_s > under_1f1b.predicted_step_s > free.predicted_step_s


def test_recomputation_is_chosen_when_only_it_fits() -> None:
    free = plan(
        heavy_activations(), workers=4, schedules=("gpipe",), microbatches=(8,), replication=False
    )
    assert free.recompute == "never"
    # recomputation frees the activations but not the outputs sent, kept to the step's end
    limit = max(free.stage_memory_bytes) * 0.7
    tight = plan(
        heavy_activations(),
        workers=4,
        schedules=("gpipe",),
        microbatches=(8,),
        replication=False,
        memory_limit=limit,
    )
    assert tight.recompute in ("except_last", "always")
    assert max(tight.stage_memory_bytes) <= limit
    assert tight.predicted_step_s > free.predicted_step_s


@pytest.mark.parametrize("limit", [3e9, 6e9, 12e9, 40e9])
def test_the_chosen_plan_fits(limit: float) -> None:
    try:
        chosen = plan(heavy_activations(), workers=4, memory_limit=limit)
    except ValueError as error:
        assert "smallest needs" in str(error)
    else:
        assert max(chosen.stage_memory_bytes) <= limit


def test_an_infeasible_limit_names_the_smallest_fit_and_the_knobs() -> None:
    with pytest.raises(ValueError) as error:
        plan(heavy_activations(), workers=4, memory_limit=1e6)
    message = str(error.value)
    for knob in ("recomputation", "micro-batches", "ranks"):
        assert knob in message
    needed = int(re.search(r"smallest needs (\d+) bytes", message).group(1))
    assert needed > 1e6
    just_enough = plan(heavy_activations(), workers=4, memory_limit=needed)
    assert max(just_enough.stage_memory_bytes) <= needed
    with pytest.raises(ValueError, match="smallest needs"):
        plan(heavy_activations(), workers=4, memory_limit=needed * (1 - 1e-6))


# ---- options and errors -------------------------------------------------------------------


def test_batch_size_sets_the_microbatch_size() -> None:
    profile = Profile(
        [LayerCost(1.0, 2.0, activation_bytes=8.0) for _ in range(4)], microbatch_size=8
    )
    chosen = plan(profile, workers=2, batch_size=64, microbatches=(1, 2, 4, 8, 3))
    assert chosen.microbatch_size * chosen.microbatches == 64 == chosen.batch_size
    with pytest.raises(ValueError, match="divides batch_size=64"):
        plan(profile, workers=2, batch_size=64, microbatches=(3, 5))


def test_replication_false_gives_one_worker_per_stage() -> None:
    chosen = plan(
        resnet_like_profile(), topology="8x300GB/s", replication=False, schedules=("1f1b",)
    )
    assert chosen.replicas == [1] * 8 and len(chosen.stages) == 8
    with pytest.raises(ValueError, match="at least one layer per rank"):
        plan(uniform(3), workers=4, replication=False)


def test_argument_errors() -> None:
    with pytest.raises(ValueError, match="schedules"):
        plan(uniform(2), workers=2, schedules=("fast",))
    with pytest.raises(ValueError, match="memory_limit"):
        plan(uniform(2), workers=2, memory_limit=0)
    with pytest.raises(ValueError, match="microbatches"):
        plan(uniform(2), workers=2, microbatches=(0,))
    with pytest.raises(TypeError, match="Profile"):
        plan([1, 2], workers=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not match"):
        plan(uniform(2), workers=3, topology="2x1GB/s")


def test_plan_json_round_trip_and_description(tmp_path) -> None:
    chosen = plan(vgg16_profile(), topology="4x16GB/s,4x10Gbit/s", batch_size=1024)
    path = tmp_path / "plan.json"
    chosen.save(path)
    assert Plan.load(path) == chosen
    text = chosen.describe()
    assert chosen.schedule in text and "0..12" in text and "samples/s" in text
    data = chosen.to_dict()
    data["format_version"] = 99
    with pytest.raises(ValueError, match="format_version 99"):
        Plan.from_dict(data)


def test_plan_stage_accessors() -> None:
    manual = Plan(
        stages=[PlanStage(0, 3, 2), PlanStage(3, 4, 1)],
        schedule="1f1b",
        microbatches=4,
        recompute="never",
        predicted_step_s=1.0,
        predicted_throughput=4.0,
        stage_memory_bytes=[1.0, 1.0],
        ranks=3,
        microbatch_size=1,
    )
    assert manual.balance == [3, 1] and manual.replicas == [2, 1] and manual.batch_size == 4


def test_a_plan_saved_before_ranks_were_named_so_still_loads() -> None:
    chosen = plan(uniform(4), workers=2, schedules=("1f1b",), microbatches=(4,))
    older = {**chosen.to_dict(), "format_version": 3, "workers": chosen.ranks}
    del older["ranks"]
    assert Plan.from_dict(older) == chosen


def test_progress_reports_layouts_and_candidates_and_changes_nothing() -> None:
    profile = Profile([LayerCost(forward_s=1.0 + i % 3, backward_s=2.0) for i in range(12)])
    lines: list[str] = []
    reported = plan(profile, workers=4, progress=lines.append)
    assert reported == plan(profile, workers=4)
    assert any("layout" in line for line in lines)
    assert any("simulated" in line for line in lines)


def test_every_worker_keeps_plans_that_leave_workers_idle_out() -> None:
    # a case where leaving 2 of 5 workers idle is fastest (a replica more would all-reduce
    # 2 GB, or 10 GB, for a single micro-batch): a job of 5 processes cannot run that plan
    profile = Profile(
        [
            LayerCost(0.41, 5.99, parameter_bytes=1e10, activation_bytes=6e6),
            LayerCost(1.39, 4.43, parameter_bytes=2e9, activation_bytes=2e4),
            LayerCost(0.46, 5.86, parameter_bytes=6e6, activation_bytes=1e6),
        ]
    )
    idle = plan(profile, topology="5x1GB/s", microbatches=(1,))
    assert sum(idle.replicas) < 5
    busy = plan(profile, topology="5x1GB/s", microbatches=(1,), every_worker=True)
    assert sum(busy.replicas) == busy.ranks == 5
    assert busy.predicted_step_s >= idle.predicted_step_s


def test_a_2bw_plan_predicts_the_step_it_will_run() -> None:
    """A 2bw step plays two updates: a batch of 8 in 2 micro-batches per update is 4
    micro-batches of 2 samples, and the prediction is that step's makespan."""
    profile = uniform(2)  # per sample: F = 1 s, B = 2 s a layer
    two_bw = plan(
        profile, workers=2, schedules=("2bw",), microbatches=(2,), batch_size=8, replication=False
    )
    one_f_one_b = plan(
        profile, workers=2, schedules=("1f1b",), microbatches=(2,), batch_size=8, replication=False
    )
    assert (two_bw.microbatch_size, two_bw.batch_size) == (2, 8)
    assert (one_f_one_b.microbatch_size, one_f_one_b.batch_size) == (4, 8)
    by_hand = simulate(build("2bw", 2, 2), Costs(forward_s=2.0, backward_s=4.0)).makespan
    assert two_bw.predicted_step_s == pytest.approx(by_hand)
    assert two_bw.predicted_throughput == pytest.approx(8 / by_hand)
    assert "2 micro-batches of 2 per update, 2 updates a step" in two_bw.describe()
    assert "2 micro-batches of 4, recomputation" in one_f_one_b.describe()


def test_a_plan_says_which_replicas_get_no_micro_batch() -> None:
    two_of_four = Plan(
        stages=[PlanStage(0, 6, 4)],
        schedule="gpipe",
        microbatches=2,
        recompute="never",
        predicted_step_s=0.1,
        predicted_throughput=640.0,
        stage_memory_bytes=[1e6],
        ranks=4,
        microbatch_size=32,
    )
    assert (
        "stage 0: 2 of its 4 replicas get a micro-batch; the other 2 only join its all-reduce"
        in (two_of_four.describe())
    )
    every_one = dataclasses.replace(two_of_four, microbatches=4, microbatch_size=16)
    assert "replicas get a micro-batch" not in every_one.describe()


@pytest.mark.parametrize(
    ("schedule", "charged"), [("pipedream", True), ("2bw", True), ("1f1b", False)]
)
def test_an_asynchronous_update_also_pays_for_its_next_weight_version(
    schedule: str, charged: bool
) -> None:
    from pipetrain.planning.candidates import Candidate
    from pipetrain.planning.layouts import Layout

    layers = [LayerCost(1.0, 2.0, parameter_bytes=1e6, optimizer_s=0.01) for _ in range(4)]
    profile = Profile(layers, weight_version_byte_s=1e-8)
    layout = Layout(((0, 3, 1), (3, 4, 1)))
    costs = Candidate(layout, schedule, 2, "never", profile).costs(Topology.flat(2, 1e9, 0.0))
    # stage 0 holds 3 MB of weights: 0.03 s of optimizer steps, and 0.03 s more to copy
    # the next version where the schedule keeps versions
    extra = 3e6 * 1e-8 if charged else 0.0
    assert costs.per_stage("step_s", 2) == pytest.approx([0.03 + extra, 0.01 + extra / 3])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "pipedream", "2bw"])
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_the_stage_sum_bound_counts_every_micro_batch_its_step_plays(
    schedule: str, stages: int
) -> None:
    # 2bw's step plays two updates' worth of micro-batches: its bound counts them all
    from pipetrain.planning.candidates import Candidate
    from pipetrain.planning.layouts import Layout

    profile = uniform(8, parameter_bytes=1e6, activation_bytes=1e5)
    share = 8 // stages
    layout = Layout(tuple((s * share, (s + 1) * share, 1) for s in range(stages)))
    for microbatches in (m for m in (1, 2, 4, 8) if layout.runs(schedule, m)):
        candidate = Candidate(layout, schedule, microbatches, "never", profile)
        costs = candidate.costs(Topology.flat(stages, 1e9, 1e-4))
        timeline, played, _ = candidate.build_and_simulate(costs)
        # each stage computes every micro-batch its step plays, 3 s each
        assert played * share * 3.0 <= candidate.lower_bound(costs) <= timeline.makespan
