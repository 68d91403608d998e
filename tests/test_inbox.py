"""A rank's receives are posted ahead of need, in its lane's order, one outstanding per peer."""

from __future__ import annotations

from collections.abc import Hashable

import torch

from pipetrain.distributed.inbox import Inbox
from pipetrain.schedules import Action, Kind


class _Posted:
    def __init__(self, log: list[str], name: str) -> None:
        self._log, self._name = log, name

    def wait(self) -> tuple[torch.Tensor, ...]:
        self._log.append(f"wait {self._name}")
        return (torch.zeros(1),)


class _Recording:
    """Records when each receive is posted and waited for."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def post_receive(self, peer: int, channel: Hashable) -> _Posted:
        name = f"{channel}@{peer}"
        self.log.append(f"post {name}")
        return _Posted(self.log, name)


def test_receives_are_posted_before_they_are_needed_one_per_peer() -> None:
    # a middle rank's lane: activations from rank 0, gradients from rank 2, in turn
    lane = [
        Action(Kind.RECV_F, 1, 0, peer=0),
        Action(Kind.FORWARD, 1, 0),
        Action(Kind.RECV_F, 1, 1, peer=0),
        Action(Kind.RECV_B, 1, 0, peer=2),
        Action(Kind.BACKWARD, 1, 0),
    ]
    transport = _Recording()
    inbox = Inbox(transport, lane)  # type: ignore[arg-type]  # records, moves nothing
    # posted at once, in the lane's order up to a second receive from a peer still owed one
    assert transport.log == ["post ('F', 0)@0"]
    for action in lane:
        if action.kind in (Kind.RECV_F, Kind.RECV_B):
            inbox.take(action)
    assert transport.log == [
        "post ('F', 0)@0",
        "wait ('F', 0)@0",
        "post ('F', 0)@0",
        "post ('B', 1)@2",
        "wait ('F', 0)@0",
        "wait ('B', 1)@2",
    ]
