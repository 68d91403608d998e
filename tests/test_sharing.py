"""Workers sharing fewer cores than there are of them: the planner's stretch of their work."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_planner import uniform

from pipetrain.planning import plan
from pipetrain.planning.sharing import MESSAGES, shared_cores_stretch, stretched
from pipetrain.simulation import Costs
from pipetrain.timeline import Event, Timeline


def _side_by_side(costs: Costs) -> Timeline:
    """Two ranks each computing one forward at the same time, nothing else."""
    forward = float(costs.per_stage("forward_s", 1)[0])
    return Timeline([Event(rank, "F", 0, 0, 0.0, forward) for rank in (0, 1)], 2)


def _one_after_another(costs: Costs) -> Timeline:
    """Rank 1's forward starts when rank 0's ends: never two busy at once."""
    first, second = costs.per_stage("forward_s", 2)
    return Timeline(
        [Event(0, "F", 0, 0, 0.0, first), Event(1, "F", 1, 0, first, first + second)], 2
    )


def _forwards(timeline: Timeline) -> list[float]:
    return [e.duration for e in timeline.events if e.kind == "F"]


def test_two_workers_computing_at_once_on_one_core_take_twice_as_long() -> None:
    costs, timeline = shared_cores_stretch(
        _side_by_side, Costs(0.01, 0.0), stages=1, workers=2, cores=1
    )
    # processor sharing: two equal jobs on one core both end at twice their time
    assert costs.per_stage("forward_s", 1) == [pytest.approx(0.02, rel=1e-3)]
    assert timeline.makespan == pytest.approx(0.02, rel=1e-3)


def test_workers_that_never_compute_at_once_do_not_stretch() -> None:
    costs, timeline = shared_cores_stretch(
        _one_after_another, Costs(0.01, 0.0), stages=2, workers=2, cores=1
    )
    assert costs.per_stage("forward_s", 2) == [0.01, 0.01]
    assert timeline.makespan == pytest.approx(0.02)


def _together_then_waiting(costs: Costs) -> Timeline:
    """Data parallelism's rhythm: both ranks compute at once, then wait together on a long
    all-reduce that needs no core."""
    forward = float(costs.per_stage("forward_s", 1)[0])
    events = []
    for rank in (0, 1):
        events += [
            Event(rank, "F", 0, 0, 0.0, forward),
            Event(rank, "ALLREDUCE", 0, None, forward, forward + 0.1),
        ]
    return Timeline(events, 2)


def test_workers_computing_in_step_stretch_however_long_they_wait_together() -> None:
    # the cores idle through most of the step, yet while both compute they share one
    costs, timeline = shared_cores_stretch(
        _together_then_waiting, Costs(0.01, 0.0), stages=1, workers=2, cores=1
    )
    assert costs.per_stage("forward_s", 1) == [pytest.approx(0.02, rel=1e-3)]
    assert _forwards(timeline) == [pytest.approx(0.02, rel=1e-3)] * 2
    assert timeline.makespan == pytest.approx(0.12, rel=1e-3)


def _sending_beside_computing(costs: Costs) -> Timeline:
    """Rank 0 packs a message while rank 1 computes a forward, then copies one in."""
    forward = float(costs.per_stage("forward_s", 2)[1])
    return Timeline(
        [
            Event(0, "SEND_F", 0, 0, 0.0, costs.send_s),
            Event(1, "F", 1, 0, 0.0, forward),
            Event(1, "RECV_F", 1, 0, forward, forward + costs.receive_s),
        ],
        2,
    )


def test_packing_and_copying_messages_take_a_core_too() -> None:
    costs = Costs(0.01, 0.0, send_s=0.01, receive_s=0.002)
    shared, timeline = shared_cores_stretch(
        _sending_beside_computing, costs, stages=2, workers=2, cores=1
    )
    # the packing and the forward share the core: with a core each the step takes 0.012 s;
    # exact processor sharing ends both at 0.02 s, then the copy at 0.022 s
    assert 0.012 * 1.5 < timeline.makespan <= 0.022 * 1.05
    assert shared.send_s > 0.01 * 1.5
    # without the message's work, a forward alone has the core: no stretch
    quiet, alone = shared_cores_stretch(
        _sending_beside_computing, Costs(0.01, 0.0), stages=2, workers=2, cores=1
    )
    assert quiet.per_stage("forward_s", 2) == [0.01, 0.01]
    assert alone.makespan == pytest.approx(0.01)


def _receiving_beside_computing(costs: Costs) -> Timeline:
    """Rank 1 copies in a message of the boundary's bytes while rank 0 computes a forward."""
    forward = float(costs.per_stage("forward_s", 2)[0])
    copy = costs.receive_busy_s(float(costs.per_stage("activation_bytes", 1)[0]))
    return Timeline(
        [Event(0, "F", 0, 0, 0.0, forward), Event(1, "RECV_F", 1, 0, forward - copy, forward)], 2
    )


def test_copying_a_messages_bytes_in_takes_a_core_too() -> None:
    # the copy's 0.01 s are its bytes' (1e6 bytes at 1e-8 s each): without them the copy is
    # too short to share the core for long; with them it takes half of it for 0.02 s
    fixed_only = Costs(0.01, 0.0, activation_bytes=1e6, receive_s=1e-6)
    per_byte = replace(fixed_only, receive_byte_s=1e-8)
    quiet, _ = shared_cores_stretch(
        _receiving_beside_computing, fixed_only, stages=2, workers=2, cores=1
    )
    busy, _ = shared_cores_stretch(
        _receiving_beside_computing, per_byte, stages=2, workers=2, cores=1
    )
    assert quiet.per_stage("forward_s", 2)[0] < 0.0101
    assert busy.per_stage("forward_s", 2)[0] > 0.015


def test_enough_cores_never_stretch() -> None:
    costs = Costs(0.01, 0.0)
    assert shared_cores_stretch(_side_by_side, costs, stages=1, workers=2, cores=2)[0] is costs


def test_shared_cores_slow_every_stages_compute_but_not_the_messages() -> None:
    costs = Costs(0.01, 0.0, send_s=0.002)
    # never two at once, yet each stage's work takes the factor's more core time
    slowed, timeline = shared_cores_stretch(
        _one_after_another, costs, stages=2, workers=2, cores=1, slowdown=1.5
    )
    assert slowed.per_stage("forward_s", 2) == [pytest.approx(0.015)] * 2
    assert slowed.send_s == 0.002  # a message's costs were measured on the shared cores
    assert timeline.makespan == pytest.approx(0.03)
    # side by side on one core: slowed, then shared
    slowed, timeline = shared_cores_stretch(
        _side_by_side, costs, stages=1, workers=2, cores=1, slowdown=1.5
    )
    assert timeline.makespan == pytest.approx(0.03, rel=1e-3)
    # a core each: nothing is shared, nothing slows
    assert (
        shared_cores_stretch(_side_by_side, costs, stages=1, workers=2, cores=2, slowdown=1.5)[0]
        is costs
    )


def test_stretched_scales_what_a_core_does_and_leaves_the_links() -> None:
    costs = Costs(
        [1.0, 2.0], 3.0, weight_s=0.5, step_s=[0.1, 0.2], send_s=0.7, receive_s=0.1,
        send_byte_s=0.25, receive_byte_s=0.125, latency_s=0.3, bandwidth=[5.0], loss_s=0.4,
    )  # fmt: skip
    longer = stretched(costs, {0: 2.0, 1: 3.0, MESSAGES: 2.0}, stages=2)
    assert longer.forward_s == [2.0, 6.0] and longer.backward_s == [6.0, 9.0]
    assert longer.weight_s == [1.0, 1.5] and longer.step_s == [0.2, pytest.approx(0.6)]
    assert (longer.send_s, longer.receive_s) == (1.4, 0.2)
    assert (longer.send_byte_s, longer.receive_byte_s) == (0.5, 0.25)
    assert (longer.latency_s, longer.bandwidth, longer.loss_s) == (0.3, [5.0], 0.4)


def test_a_plan_for_workers_sharing_cores_predicts_a_longer_step() -> None:
    profile = uniform(8)
    alone = plan(profile, workers=4, schedules=("gpipe",), microbatches=(8,))
    shared = plan(profile, workers=4, schedules=("gpipe",), microbatches=(8,), shared_cores=1)
    assert plan(
        profile, workers=4, schedules=("gpipe",), microbatches=(8,), shared_cores=4
    ).predicted_step_s == pytest.approx(alone.predicted_step_s)
    # one core does all the compute: the step is at least the whole model's work, m times
    work = sum(layer.compute_s for layer in profile.layers) * 8
    assert shared.predicted_step_s >= work * (1 - 1e-3) > alone.predicted_step_s
    # work that takes more core time on shared cores lengthens the shared step alone
    slower = replace(profile, shared_cores_factor=1.25)
    options = {"workers": 4, "schedules": ("gpipe",), "microbatches": (8,)}
    assert plan(slower, **options).predicted_step_s == pytest.approx(alone.predicted_step_s)
    slower_shared = plan(slower, **options, shared_cores=1).predicted_step_s
    assert slower_shared >= 1.25 * work * (1 - 1e-3)
    with pytest.raises(ValueError, match="shared_cores must be a positive integer"):
        plan(profile, workers=4, shared_cores=0)
