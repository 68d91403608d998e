"""A rank's receives for one run of its actions, posted ahead of need.

Posted early, a receive's data lands while the rank computes, and the receive action
only waits. Receives are posted in the lane's order, one outstanding per peer: messages
from one peer are matched in order, and a channel's first message is two (shapes, then
data), so a second receive posted on the same peer could take the wrong one.

On a slow link this is what lets a message cross while the receiver computes: gloo reads
a message only into a posted receive, so without one only what the sockets buffer crosses
early and the rest waits for the receive action (at 100 Mbit/s, 152 against 168 ms a VGG
step on four hosts). On one machine it measured no slower.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.distributed.transport import PendingReceive, Tensors, Transport
from pipetrain.schedules import RECV_KINDS, Action
from pipetrain.schedules.messages import channel


class Inbox:
    """Receives the messages of ``lane``'s receive actions through ``transport``."""

    def __init__(self, transport: Transport, lane: Sequence[Action]) -> None:
        """Post ``lane``'s receives early, in order, one outstanding per peer."""
        self._transport = transport
        self._receives = [a for a in lane if a.kind in RECV_KINDS]
        self._next = 0
        self._posted: dict[Action, PendingReceive] = {}
        self._busy: set[int] = set()
        self._post()

    def _post(self) -> None:
        while self._next < len(self._receives):
            action = self._receives[self._next]
            assert action.peer is not None  # every lowered receive names its peer
            if action.peer in self._busy:
                return
            self._busy.add(action.peer)
            self._posted[action] = self._transport.post_receive(action.peer, channel(action))
            self._next += 1

    def take(self, action: Action) -> Tensors:
        """The tensors that receive ``action`` brings (blocking)."""
        # receives are taken in the lane's order, so this one was posted when the last was taken
        tensors = self._posted.pop(action).wait()
        self._busy.discard(action.peer)
        self._post()
        return tensors
