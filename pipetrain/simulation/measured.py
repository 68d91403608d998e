"""Simulator costs recovered from measured timelines, so predictions can be checked against runs."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from pipetrain.simulation.costs import Costs
from pipetrain.timeline import Timeline


def measured_costs(timelines: Timeline | Sequence[Timeline], stages: int) -> Costs:
    """Simulator costs from measured timelines, each event kept as the kind it was recorded as.

    Per stage, the median F, B, W, STEP, ALLREDUCE, GATHER and LOAD durations, and the
    longest OFFLOAD (the one that carried the stage's gradients; one after forwards only
    carries none). A send's time on the sending
    rank (packing the message) is the median send, ``send_s``, which the simulator charges
    on the sender's lane as a send again, never as compute. A measured receive is waiting
    plus copying the data in; the shortest receive (one whose data was already there) gives
    ``receive_s``. The latency is :func:`transfer_time` less that copy, which the simulator
    adds after a message lands. Several timelines (steps) may be given: medians are then
    over all of them, which steadies noisy measurements.
    """
    runs = [timelines] if isinstance(timelines, Timeline) else list(timelines)

    def per_stage(
        kind: str, statistic: Callable[[list[float]], float] = statistics.median
    ) -> list[float]:
        durations: list[list[float]] = [[] for _ in range(stages)]
        for timeline in runs:
            for event in timeline.events:
                if event.kind == kind and event.stage is not None:
                    durations[event.stage].append(event.duration)
        return [statistic(values) if values else 0.0 for values in durations]

    def durations(kinds: tuple[str, ...]) -> list[float]:
        return [e.duration for t in runs for e in t.events if e.kind in kinds]

    sends = durations(("SEND_F", "SEND_B", "SEND_T", "SEND_O"))
    receive_s = min(durations(("RECV_F", "RECV_B")), default=0.0)
    transfer = statistics.median(transfer_time(timeline) for timeline in runs) if runs else 0.0
    return Costs(
        forward_s=per_stage("F"),
        backward_s=per_stage("B"),
        weight_s=per_stage("W"),
        step_s=per_stage("STEP"),
        allreduce_s=per_stage("ALLREDUCE"),
        gather_s=per_stage("GATHER"),
        load_s=per_stage("LOAD"),
        offload_s=per_stage("OFFLOAD", max),
        send_s=statistics.median(sends) if sends else 0.0,
        receive_s=receive_s,
        latency_s=max(0.0, transfer - receive_s),
    )


def transfer_time(timeline: Timeline) -> float:
    """Median time a message spends between the end of its send and the end of its receive.

    Only the part of the receive that follows the send counts, so a receiver that arrives
    late (the data already there) adds only its own copy time. 0 without transfers.
    """
    sends = {
        (e.kind, e.stage, e.microbatch): e
        for e in timeline.events
        if e.kind in ("SEND_F", "SEND_B")
    }
    senders = {
        "RECV_F": ("SEND_F", -1),
        "RECV_B": ("SEND_B", +1),
    }  # receive kind -> send kind, stage offset
    gaps = []
    for event in timeline.events:
        if event.kind not in senders or event.stage is None:
            continue
        kind, offset = senders[event.kind]
        send = sends.get((kind, event.stage + offset, event.microbatch))
        if send is not None:
            gaps.append(max(0.0, event.end - max(send.end, event.start)))
    return statistics.median(gaps) if gaps else 0.0
