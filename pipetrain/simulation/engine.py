"""Play a schedule against costs and produce a predicted :class:`~pipetrain.timeline.Timeline`.

Every rank runs its actions in order, and each becomes an event of the kind the runtime's
recorder gives it, on the same rank. Compute takes the stage's cost. A send keeps its rank
busy for ``Costs.send_s`` and ``Costs.send_byte_s`` a byte it carries (packing the message
and handing its bytes to the transport; its ``SEND_*`` event), then the message
crosses the network without the sender: its bytes hold the sender's outgoing link, and
share the peer's incoming one with the messages crossing it at once
(:class:`~pipetrain.simulation.ports.Ports`: one link each way per rank; a rank's own
messages leave one after another, in the order it issues them) and it lands
``Costs.latency_s`` after its last byte, so back-to-back messages overlap their latencies;
a receive's event runs from when the rank reaches it until its message has landed and been
copied in (``Costs.receive_s`` and ``Costs.receive_byte_s`` a byte); an all-reduce starts
when every replica of the stage has reached it. An overlapped pair's forward and backward
together take the longer of the two plus the part of the shorter that ``Costs.overlap``
does not hide, shared between them in proportion; its ``OVERLAP`` marker is an event of
no length, as recorded. A ``LOAD`` of a stage's weights from the host store takes the
rank's link from the host, not its compute, and the stage's passes wait for it; an
``OFFLOAD`` of its gradients takes the link back (:mod:`~pipetrain.simulation.host_link`).
"""

from __future__ import annotations

import random
import statistics
from collections import defaultdict, deque
from collections.abc import Sequence

from pipetrain.allocation import collector_paused
from pipetrain.checks import positive_int
from pipetrain.schedules import SEND_KINDS, Kind, Schedule
from pipetrain.schedules.actions import HOST_KINDS
from pipetrain.schedules.messages import CHANNELS
from pipetrain.simulation.costs import Costs, Variation
from pipetrain.simulation.host_link import HostLinks
from pipetrain.simulation.ports import Ports
from pipetrain.timeline import Event, Timeline, trusted_event


def simulate(
    schedule: Schedule, costs: Costs, variation: Variation | None = None, seed: int = 0
) -> Timeline:
    """Execute ``schedule`` on ``costs`` and return the predicted timeline.

    With ``variation``, every forward, backward and weight-gradient action is its cost times
    a factor drawn from the variation (random, repeatable for one ``seed``): one possible
    step of a pipeline whose actions vary as measured. Each action is played once: a rank
    runs until it waits for a message or a collective, and whatever ends the wait puts it
    back on the work list.
    """
    with collector_paused():
        return _play(schedule, costs, variation, seed)


def _play(schedule: Schedule, costs: Costs, variation: Variation | None, seed: int) -> Timeline:
    """The body of :func:`simulate`."""
    stages, num_ranks = schedule.stages, schedule.num_ranks
    boundaries = max(stages - 1, 1)
    activation = costs.per_stage("activation_bytes", boundaries)
    bandwidth = costs.per_stage("bandwidth", boundaries)
    if any(b == 0 for b in bandwidth):
        raise ValueError("Costs.bandwidth must be positive")
    for name in ("latency_s", "send_s", "receive_s", "send_byte_s", "receive_byte_s", "loss_s"):
        if not getattr(costs, name) >= 0:
            raise ValueError(
                f"Costs.{name} must be a non-negative number of seconds, "
                f"got {getattr(costs, name)!r}"
            )
    if not 0 <= costs.overlap <= 1:
        raise ValueError(f"Costs.overlap must be between 0 and 1, got {costs.overlap!r}")
    duration = _durations(schedule, costs)
    scales = _overlap_scales(schedule, duration, costs.overlap)
    draw = random.Random(seed).choice
    factors: dict[Kind, Sequence[Sequence[float]]] = {}
    if variation is not None:
        variation.check(stages)
        factors = {
            Kind.FORWARD: variation.forward,
            Kind.BACKWARD: variation.backward,
            Kind.WEIGHT: variation.backward,
        }
    latency = costs.latency_s
    compute_scale, bytes_scale = costs.microbatch_scales(stages, schedule.microbatches)
    uniform = not costs.compute_scale and not costs.bytes_scale
    # a message's wire and busy times per (micro-batch, boundary), one row per distinct size
    # factor (often only 1.0); whole-step messages carry no bytes
    rows = {
        k: (
            [size * k / speed for size, speed in zip(activation, bandwidth)],
            [costs.send_busy_s(size * k) for size in activation],
            [costs.receive_busy_s(size * k) for size in activation],
        )
        for k in set(bytes_scale)
    }
    wire_s, send_s, receive_s = ([rows[k][part] for k in bytes_scale] for part in range(3))
    wired = any(wire > 0 for row in rows.values() for wire in row[0])  # else no ports used
    small_send_s, small_receive_s = costs.send_s, costs.receive_s
    collective_s = {
        Kind.ALLREDUCE: costs.per_stage("allreduce_s", stages),
        Kind.GATHER: costs.per_stage("gather_s", stages),
        Kind.LOSS: [costs.loss_s],
    }
    groups = {
        Kind.ALLREDUCE: schedule.stage_ranks,
        Kind.GATHER: schedule.stage_ranks,
        Kind.LOSS: [tuple(range(num_ranks))],
    }

    names = {kind: kind.value for kind in Kind}  # plain strings, looked up fast
    make = trusted_event  # every value below is already a plain int, str or float
    clock = [0.0] * num_ranks
    position = [0] * num_ranks
    events: list[Event] = []
    # (receiver, family, boundary, micro-batch): a message's key on the rank receiving it
    arrival: dict[tuple[int, str, int, int | None], float] = {}  # -> time it lands, no wire
    ports = Ports(num_ranks)  # the messages with bytes on the wire
    waiting_on: dict[tuple[int, str, int, int | None], int] = {}
    arrived: dict[tuple[Kind, int, int], dict[int, float]] = defaultdict(dict)
    collectives_done: list[dict[tuple[Kind, int], int]] = [
        defaultdict(int) for _ in range(num_ranks)
    ]
    runnable = deque(range(num_ranks))
    # send or receive kind -> its event's name, its channel's (family, offset, whole step),
    # and whether it sends: one lookup sorts out every transfer
    transfers = {kind: (kind.value, *CHANNELS[kind], kind in SEND_KINDS) for kind in CHANNELS}
    lanes, append, varied = schedule.ranks, events.append, bool(factors)
    links = HostLinks(schedule, costs) if schedule.host_stored else None
    # compute costs its stage's time, scaled only in an overlapped pair, unless something
    # else scales or delays it
    plain = uniform and not varied and links is None
    while runnable:
        rank = runnable.popleft()
        actions, lane_scales = lanes[rank], scales[rank]
        now = clock[rank]
        stop = len(actions)
        for index in range(position[rank], stop):
            kind, stage, mb, peer, _ = actions[index]
            spans = duration.get(kind)
            if spans is not None:
                if plain:
                    if lane_scales and index in lane_scales:
                        end = now + spans[stage] * lane_scales[index]
                    else:
                        end = now + spans[stage]
                else:
                    cost = spans[stage]
                    if not uniform and mb is not None:
                        cost *= compute_scale[mb][stage]
                    if lane_scales:
                        cost *= lane_scales.get(index, 1.0)
                    if varied and kind in factors:
                        cost *= draw(factors[kind][stage])
                    if links is not None:
                        now = max(now, links.ready(rank, stage))  # its weights have arrived
                    end = now + cost
                append(make((rank, names[kind], stage, mb, now, end)))
                now = end
                continue
            transfer = transfers.get(kind)
            if transfer is not None:
                name, family, offset, whole_step, outgoing = transfer
                boundary = 0 if whole_step else stage + offset
                if outgoing:
                    peer = peer if peer is not None else -1
                    key = (peer, family, boundary, mb)
                    # the sender packs the message, then the link carries it without the
                    # sender
                    end = now + (small_send_s if whole_step else send_s[mb or 0][boundary])
                    append(make((rank, name, stage, mb, now, end)))
                    now = end
                    # the bytes cross both ranks' links; the latency follows them off, so
                    # messages sent back to back overlap their latencies
                    if wired and not whole_step and wire_s[mb or 0][boundary] > 0:
                        ports.carry(rank, peer, now, wire_s[mb or 0][boundary], key)
                    else:
                        arrival[key] = now + latency
                    waiter = waiting_on.pop(key, None)
                    if waiter is not None:
                        runnable.append(waiter)
                    continue
                key = (rank, family, boundary, mb)
                landed = arrival.pop(key, None)
                if landed is None:
                    last_byte = ports.take(key) if wired else None
                    if last_byte is None:
                        waiting_on[key] = rank
                        break
                    landed = last_byte + latency
                busy = small_receive_s if whole_step else receive_s[mb or 0][boundary]
                end = (landed if landed > now else now) + busy
                append(make((rank, name, stage, mb, now, end)))
                now = end
            elif kind is Kind.OVERLAP:  # a marker: its pair's passes follow, scaled
                append(make((rank, names[kind], stage, mb, now, now)))
            elif kind in HOST_KINDS and links is not None:  # on the host link, not the rank
                start, end = links.move(rank, index, kind, stage, now)
                append(make((rank, names[kind], stage, mb, start, end)))
            else:  # ALLREDUCE and GATHER over the stage's replicas, LOSS over every rank
                position[rank] = index
                scope = 0 if kind is Kind.LOSS else stage
                group = groups[kind][scope]
                count = collectives_done[rank][(kind, scope)]
                members = arrived[(kind, scope, count)]
                members[rank] = now
                if len(members) < len(group):
                    break
                start = max(members.values())
                end = start + collective_s[kind][scope]
                for member in group:
                    own = lanes[member][position[member]]  # each rank's own stage
                    append(make((member, names[kind], own.stage, None, start, end)))
                    clock[member] = end
                    collectives_done[member][(kind, scope)] += 1
                    position[member] += 1
                    if member != rank:
                        runnable.append(member)
                now = end  # and on to the next action, as position[rank] now says
        else:  # every action played
            index = stop
        clock[rank], position[rank] = now, index
    unfinished = [r for r in range(num_ranks) if position[r] < len(schedule.ranks[r])]
    if unfinished:
        raise RuntimeError(
            f"simulation of {schedule.name} stopped with ranks {unfinished} waiting; "
            "validate the schedule first"
        )
    return Timeline.trusted(events, num_ranks, schedule.name)  # events of ranks 0..n-1


def _durations(schedule: Schedule, costs: Costs) -> dict[Kind, list[float]]:
    """Per-stage time of each compute kind and of the optimizer step."""
    stages = schedule.stages
    forward, backward, weight, step = (
        costs.per_stage(name, stages) for name in ("forward_s", "backward_s", "weight_s", "step_s")
    )
    unsplit = [b + w for b, w in zip(backward, weight)]
    return {
        Kind.FORWARD: forward,
        Kind.BACKWARD: backward if schedule.split_backward else unsplit,
        Kind.WEIGHT: weight,
        Kind.STEP: step,
    }


def _overlap_scales(
    schedule: Schedule, duration: dict[Kind, list[float]], overlap: float
) -> list[dict[int, float]]:
    """Per rank, the index of each overlapped pass -> the factor on its cost that makes its
    pair last ``max + (1 − overlap)·min`` of the two passes."""
    forward, backward = duration[Kind.FORWARD], duration[Kind.BACKWARD]
    # (forward's stage, backward's stage) -> factor, or None for two passes of no time:
    # a V schedule pairs few distinct stages, many times over
    by_stages: dict[tuple[int, int], float | None] = {}
    scales: list[dict[int, float]] = []
    for lane, lane_pairs in zip(schedule.ranks, schedule.overlapped):
        lane_scales: dict[int, float] = {}
        for b_index, f_index in lane_pairs.items():
            key = (lane[f_index][1], lane[b_index][1])
            if key not in by_stages:
                f, b = forward[key[0]], backward[key[1]]
                by_stages[key] = (
                    (max(f, b) + (1 - overlap) * min(f, b)) / (f + b) if f + b > 0 else None
                )
            scale = by_stages[key]
            if scale is not None:
                lane_scales[f_index] = lane_scales[b_index] = scale
        scales.append(lane_scales)
    return scales


def median_makespan(
    schedule: Schedule, costs: Costs, variation: Variation, runs: int = 64, seed: int = 0
) -> float:
    """The median makespan of ``runs`` simulated steps under ``variation`` (seeds ``seed``,
    ``seed + 1``, ...).

    A step waits for its slowest path, so its typical length exceeds the step of median
    actions: slow actions add up along the path, and a slow stage holds up those after it.
    """
    positive_int("runs", runs)
    return statistics.median(
        simulate(schedule, costs, variation, seed + run).makespan for run in range(runs)
    )
