"""Workers sharing fewer cores than there are of them: the planner's compute stretch."""

from __future__ import annotations

import pytest
from test_planner import uniform

from pipetrain.planning import plan
from pipetrain.planning.sharing import shared_cores_stretch, stretched
from pipetrain.simulation import Costs
from pipetrain.timeline import Event, Timeline


def _side_by_side(costs: Costs) -> Timeline:
    """Two ranks each computing one forward at the same time, nothing else."""
    forward = float(costs.per_stage("forward_s", 1)[0])
    return Timeline([Event(rank, "F", 0, 0, 0.0, forward) for rank in (0, 1)], 2)


def _one_after_another(costs: Costs) -> Timeline:
    """Rank 1's forward starts when rank 0's ends: never two busy at once."""
    forward = float(costs.per_stage("forward_s", 1)[0])
    return Timeline(
        [Event(0, "F", 0, 0, 0.0, forward), Event(1, "F", 1, 0, forward, 2 * forward)], 2
    )


def test_two_workers_computing_at_once_on_one_core_take_twice_as_long() -> None:
    factor, timeline = shared_cores_stretch(_side_by_side, Costs(0.01, 0.0), workers=2, cores=1)
    # processor sharing: two equal jobs on one core both end at twice their time
    assert factor == pytest.approx(2.0, rel=1e-3)
    assert timeline.makespan == pytest.approx(0.02, rel=1e-3)


def test_workers_that_never_compute_at_once_do_not_stretch() -> None:
    factor, timeline = shared_cores_stretch(
        _one_after_another, Costs(0.01, 0.0), workers=2, cores=1
    )
    assert factor == 1.0
    assert timeline.makespan == pytest.approx(0.02)


def _sending_beside_computing(costs: Costs) -> Timeline:
    """Rank 0 packs a message (and rank 1 copies one in after waiting) while rank 1
    computes a forward as long as the packing."""
    forward = float(costs.per_stage("forward_s", 1)[0])
    return Timeline(
        [
            Event(0, "SEND_F", 0, 0, 0.0, costs.send_s),
            Event(1, "F", 1, 0, 0.0, forward),
            Event(1, "RECV_B", 1, 0, forward, forward + costs.receive_s),
        ],
        2,
    )


def test_packing_and_copying_messages_take_a_core_too() -> None:
    costs = Costs(0.01, 0.0, send_s=0.01, receive_s=0.002)
    factor, timeline = shared_cores_stretch(_sending_beside_computing, costs, workers=2, cores=1)
    # 0.022 core-seconds of work in a step of 0.012 s at most on one core: it stretches
    # until the step holds it, (0.012 f >= 0.022)
    assert factor == pytest.approx(0.022 / 0.012, rel=1e-3)
    assert timeline.makespan == pytest.approx(0.022, rel=1e-3)
    # with the message's work left out, a forward alone fits the one core: no stretch
    quiet = Costs(0.01, 0.0)
    assert shared_cores_stretch(_sending_beside_computing, quiet, workers=2, cores=1)[0] == 1.0


def test_enough_cores_never_stretch() -> None:
    assert shared_cores_stretch(_side_by_side, Costs(0.01, 0.0), workers=2, cores=2)[0] == 1.0


def test_stretched_scales_what_a_core_does_and_leaves_the_links() -> None:
    costs = Costs(
        [1.0, 2.0], 3.0, weight_s=0.5, step_s=[0.1, 0.2], send_s=0.7, receive_s=0.1,
        latency_s=0.3, bandwidth=[5.0], loss_s=0.4,
    )  # fmt: skip
    longer = stretched(costs, 2.0)
    assert longer.forward_s == [2.0, 4.0] and longer.backward_s == 6.0
    assert longer.weight_s == 1.0 and longer.step_s == [0.2, 0.4]
    assert (longer.send_s, longer.receive_s) == (1.4, 0.2)
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
    with pytest.raises(ValueError, match="shared_cores must be a positive integer"):
        plan(profile, workers=4, shared_cores=0)
