"""The bubble means one thing on measured and simulated timelines: the share of rank-time
outside compute and optimizer steps, with a send's packing on its sender, a receive's wait
and copy on its receiver, and the simulator's events of the kinds the runtime records."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipetrain.schedules import Schedule, build, with_targets_shipped
from pipetrain.simulation import Costs, measured_costs, simulate
from pipetrain.timeline import Event, Timeline


def measured_gpipe() -> Timeline:
    """2 ranks, gpipe, 2 micro-batches, as a run records it, written out by hand.

    Forward 1 s (stage 0) and 1.5 s (stage 1), backward 2 s, optimizer step 0.5 s; a send
    packs for 0.5 s on its sender, its message lands 0.2 s later and a receive copies it in
    for 0.1 s. ``RECV_F1.1`` finds its data there; the other receives wait for it.
    """
    e = Event
    return Timeline(
        [
            e(0, "F", 0, 0, 0.0, 1.0),
            e(0, "SEND_F", 0, 0, 1.0, 1.5),  # lands at 1.7
            e(0, "F", 0, 1, 1.5, 2.5),
            e(0, "SEND_F", 0, 1, 2.5, 3.0),  # lands at 3.2
            e(0, "RECV_B", 0, 0, 3.0, 7.7),
            e(0, "B", 0, 0, 7.7, 9.7),
            e(0, "RECV_B", 0, 1, 9.7, 10.2),
            e(0, "B", 0, 1, 10.2, 12.2),
            e(0, "STEP", 0, None, 12.2, 12.7),
            e(0, "LOSS", 0, None, 12.7, 12.7),
            e(1, "RECV_F", 1, 0, 0.0, 1.8),
            e(1, "F", 1, 0, 1.8, 3.3),
            e(1, "RECV_F", 1, 1, 3.3, 3.4),
            e(1, "F", 1, 1, 3.4, 4.9),
            e(1, "B", 1, 0, 4.9, 6.9),
            e(1, "SEND_B", 1, 0, 6.9, 7.4),  # lands at 7.6
            e(1, "B", 1, 1, 7.4, 9.4),
            e(1, "SEND_B", 1, 1, 9.4, 9.9),  # lands at 10.1
            e(1, "STEP", 1, None, 9.9, 10.4),
            e(1, "LOSS", 1, None, 10.4, 12.7),  # waits for rank 0
        ],
        num_ranks=2,
    )


# compute and steps: rank 0 2 + 4 + 0.5 s, rank 1 3 + 4 + 0.5 s, over 2 ranks × 12.7 s
HAND_BUBBLE = 1 - 14.0 / (2 * 12.7)


def test_the_bubble_leaves_out_sends_receives_and_collectives() -> None:
    measured = measured_gpipe()
    assert measured.makespan == pytest.approx(12.7)
    assert measured.bubble_fraction == pytest.approx(HAND_BUBBLE)


def test_measured_costs_and_simulate_reproduce_a_measured_bubble() -> None:
    measured = measured_gpipe()
    costs = measured_costs(measured, stages=2)
    assert costs.forward_s == pytest.approx([1.0, 1.5])  # sends are not folded into compute
    assert costs.backward_s == pytest.approx([2.0, 2.0])
    assert (costs.send_s, costs.receive_s, costs.latency_s) == pytest.approx((0.5, 0.1, 0.2))
    predicted = simulate(build("gpipe", 2, 2), costs)
    assert predicted.makespan == pytest.approx(12.7)
    assert predicted.bubble_fraction == pytest.approx(HAND_BUBBLE)
    # every event where it was measured, the loss all-reduce apart: the simulator starts
    # it once every rank has reached it, where a rank records its own wait in it
    pairs = zip(
        [e for e in predicted.events if e.kind != "LOSS"],
        [e for e in measured.events if e.kind != "LOSS"],
    )
    for simulated, recorded in pairs:
        assert simulated[:4] == recorded[:4]
        assert (simulated.start, simulated.end) == pytest.approx((recorded.start, recorded.end))


def test_a_send_keeps_its_sender_busy_before_the_message_travels() -> None:
    costs = Costs(forward_s=1.0, backward_s=2.0, send_s=0.25, receive_s=0.1, latency_s=0.05)
    timeline = simulate(build("gpipe", 2, 1), costs)
    send = next(e for e in timeline.events if e.kind == "SEND_F")
    assert (send.rank, send.start, send.end) == (0, 1.0, 1.25)
    # F0, pack, travel, copy, F1, B1, pack, travel, copy, B0
    assert timeline.makespan == pytest.approx(1 + 0.4 + 1 + 2 + 0.4 + 2)
    busy = 2 * (1 + 2)
    assert timeline.bubble_fraction == pytest.approx(1 - busy / (2 * timeline.makespan))


@pytest.mark.parametrize(
    "schedule",
    [
        build("1f1b", 3, 6),
        build("interleaved", 2, 4),
        build("2bw", 2, 4),
        build("dualpipev", 2, 4),
        build("1f1b", 3, 4, replicas=[2, 1]),
    ],
    ids=["1f1b", "interleaved", "2bw", "dualpipev", "replicated"],
)
def test_a_simulated_rank_has_an_event_per_action_as_the_runtime_records(
    schedule: Schedule,
) -> None:
    # the executor records every action of its lane as (kind, stage, micro-batch)
    shipped = with_targets_shipped(schedule.ranks, schedule.stage_ranks)
    costs = Costs(forward_s=1.0, backward_s=2.0, weight_s=0.5, send_s=0.1, receive_s=0.05)
    timeline = simulate(replace(schedule, ranks=shipped), costs)
    for rank, lane in enumerate(shipped):
        recorded = sorted((a.kind.value, a.stage, a.microbatch) for a in lane)
        simulated = sorted((e.kind, e.stage, e.microbatch) for e in timeline.rank_events(rank))
        assert simulated == recorded
