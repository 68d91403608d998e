"""Each rank's network port: the one link each way between a worker and the network.

A worker's messages to all of its peers leave through one interface, and its messages from
all of them arrive through one. A rank's outgoing link sends its messages one after
another, in the order it issues them. Its incoming link is shared fairly among the
messages crossing it at once, as TCP shares a congested link among its flows: three
replicas that each send a 2 s message to one worker at the same moment all land at 6 s,
not one at 2 s, one at 4 s and one at 6 s. Which message lands first decides when the
receiver can start, so the difference is the pipeline's fill time.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(slots=True)
class _Flow:
    """A message on an incoming link: its bytes start at ``ready`` and take ``wire_s`` at
    the link's full speed. ``ends`` is when its last byte arrives with the link shared;
    ``busy_until``, the latest ``ends`` from the start of its busy period (the link never
    idle since) to it."""

    ready: float
    wire_s: float
    ends: float
    busy_until: float


class Ports:
    """When each rank's outgoing link is free, and the messages on each incoming link.

    A rank's sends reach :meth:`carry` in the order it issues them, so its outgoing link is
    a single time. Messages from several senders reach a receiver's incoming link in
    whatever order the simulation plays the senders, so each new one shares the link anew
    with those it overlaps: their arrival times move, until the receiver has taken them
    (:meth:`take`), after which they stay as they were.
    """

    def __init__(self, ranks: int) -> None:
        """Every link free from time 0."""
        self._out_free = [0.0] * ranks
        self._incoming: list[list[_Flow]] = [[] for _ in range(ranks)]  # by ``ready``
        self._flows: dict[Hashable, _Flow] = {}

    def carry(self, sender: int, receiver: int, ready: float, wire_s: float, key: Hashable) -> None:
        """Put a message on the wire: ready at ``ready``, it leaves once ``sender``'s
        earlier messages have, and its bytes take ``wire_s`` at full speed; ``receiver``'s
        incoming link shares its speed among the messages crossing it at once (``receiver``
        < 0: no receiving link, as for a message with no peer). :meth:`take` with ``key``
        gives when its last byte arrives."""
        start = max(ready, self._out_free[sender])
        self._out_free[sender] = start + wire_s
        flow = _Flow(start, wire_s, start + wire_s, start + wire_s)
        self._flows[key] = flow
        if receiver >= 0:
            flows = self._incoming[receiver]
            index = bisect.bisect_right(flows, start, key=_ready)
            flows.insert(index, flow)
            # the link's busy period that the message joins; those before it do not change
            while index > 0 and flows[index - 1].busy_until > flows[index].ready:
                index -= 1
            if index < len(flows) - 1 or flows[index] is not flow:  # not alone on the link
                _share(flows, index)

    def take(self, key: Hashable) -> float | None:
        """When the last byte of the message ``key`` arrives, from now on fixed; ``None`` if
        it has not been sent, or was taken already."""
        flow = self._flows.pop(key, None)
        return None if flow is None else flow.ends


def _share(flows: list[_Flow], first: int) -> None:
    """Set ``ends`` and ``busy_until`` of the flows in the busy period that starts at
    ``first`` (flows sorted by ``ready``): the link's speed shared equally among the flows
    crossing it at once. A flow taken already still shares the link, though its receiver
    keeps the time it was given. The period ends where the link falls idle; adding a flow
    only adds work, so the periods after it were idle-separated before too, and are as they
    were."""
    now, index = flows[first].ready, first
    active: list[tuple[_Flow, float]] = []  # each crossing flow and the wire time it has left
    while True:
        while index < len(flows) and flows[index].ready <= now:
            active.append((flows[index], flows[index].wire_s))
            index += 1
        if not active:
            break  # idle until the next flow, if any
        share = len(active)
        finishing = min(left for _, left in active)
        arrival = flows[index].ready if index < len(flows) else math.inf
        step = min(finishing * share, arrival - now)  # until a flow ends or another starts
        now += step
        crossing = []
        for flow, left in active:
            left -= step / share
            if left <= 1e-9 * flow.wire_s:  # ended, but for rounding
                flow.ends = now
            else:
                crossing.append((flow, left))
        active = crossing
    latest = -math.inf
    for flow in flows[first:index]:
        latest = max(latest, flow.ends)
        flow.busy_until = latest


def _ready(flow: _Flow) -> float:
    """The order of an incoming link's flows."""
    return flow.ready
