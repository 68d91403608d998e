"""A rank's receives for one run of its actions, posted ahead of need.

Posted early, a receive's data lands while the rank computes, and the receive action
only waits. Each stream of messages has one receive outstanding at a time, its next in
the lane's order: messages in a stream are matched in order, and a channel's first message
is two (shapes, then data), so a second receive posted on the same stream could take the
wrong one. A stream is a peer's messages on one channel where the transport matches
channels apart (gloo, by tag), else all of a peer's messages.

On a slow link this is what lets a message cross while the receiver computes: gloo reads
a message only into a posted receive, so without one only what the sockets buffer crosses
early and the rest waits for the receive action (at 100 Mbit/s, 152 against 168 ms a VGG
step on four hosts). On one machine it measured no slower. And gloo's sender sends a
message's bytes only once the receive is posted: posted late, the sender's event-loop
thread must wake to send them, which it does late while the sender computes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence

from pipetrain.distributed.transport import PendingReceive, Tensors, Transport
from pipetrain.schedules import RECV_KINDS, Action
from pipetrain.schedules.messages import channel


class Inbox:
    """Receives the messages of ``lane``'s receive actions through ``transport``."""

    def __init__(self, transport: Transport, lane: Sequence[Action]) -> None:
        """Post the first receive of each of ``lane``'s streams."""
        self._transport = transport
        self._apart = transport.channels_apart
        self._streams: dict[Hashable, deque[Action]] = {}
        for action in lane:
            if action.kind in RECV_KINDS:
                self._streams.setdefault(self._stream(action), deque()).append(action)
        self._posted: dict[Action, PendingReceive] = {}
        for stream in self._streams.values():
            self._post(stream[0])

    def _stream(self, action: Action) -> Hashable:
        return (action.peer, channel(action)) if self._apart else action.peer

    def _post(self, action: Action) -> None:
        assert action.peer is not None  # every lowered receive names its peer
        self._posted[action] = self._transport.post_receive(action.peer, channel(action))

    def take(self, action: Action) -> Tensors:
        """The tensors that receive ``action`` brings (blocking)."""
        # receives are taken in the lane's order, so this one heads its stream
        tensors = self._posted.pop(action).wait()
        stream = self._streams[self._stream(action)]
        stream.popleft()
        if stream:
            self._post(stream[0])
        return tensors
