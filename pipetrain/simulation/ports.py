"""Each rank's network port: the one link each way between a worker and the network.

A worker's messages to all of its peers leave through one interface, and its messages from
all of them arrive through one, so a stage that sends to or receives from several replicas
of its neighbour (or sends forward and back at once) shares that link among them.
"""

from __future__ import annotations

import bisect


class Ports:
    """When each rank's outgoing link is free, and the intervals its incoming link is busy.

    A rank's sends reach :meth:`carry` in the order it issues them, so its outgoing link is
    a single time. Messages from several senders reach a receiver's incoming link in
    whatever order the simulation plays the senders, so it keeps its busy intervals and
    gives each message the earliest gap that holds it.
    """

    def __init__(self, ranks: int) -> None:
        """Every link free from time 0."""
        self._out_free = [0.0] * ranks
        self._in_starts: list[list[float]] = [[] for _ in range(ranks)]
        self._in_ends: list[list[float]] = [[] for _ in range(ranks)]

    def carry(self, sender: int, receiver: int, ready: float, wire_s: float) -> float:
        """When the last byte of a message leaves, if it is ready at ``ready`` and its bytes
        take ``wire_s`` on the wire; both links are held meanwhile (``receiver`` < 0: no
        receiving link, as for a message with no peer)."""
        start = max(ready, self._out_free[sender])
        if receiver >= 0:
            starts, ends = self._in_starts[receiver], self._in_ends[receiver]
            index = bisect.bisect_right(ends, start)  # the first busy interval after start
            while index < len(starts) and starts[index] < start + wire_s:
                start = max(start, ends[index])
                index += 1
            starts.insert(index, start)
            ends.insert(index, start + wire_s)
        self._out_free[sender] = start + wire_s
        return start + wire_s
