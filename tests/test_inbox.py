"""A rank's receives are posted ahead of need, one outstanding per stream: a peer's
messages on one channel where the transport matches channels apart, else all of a peer's."""

from __future__ import annotations

from collections.abc import Hashable

import pytest
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

    def __init__(self, channels_apart: bool) -> None:
        self.channels_apart = channels_apart
        self.log: list[str] = []

    def post_receive(self, peer: int, channel: Hashable) -> _Posted:
        name = f"{channel}@{peer}"
        self.log.append(f"post {name}")
        return _Posted(self.log, name)


# a middle rank's lane: activations from rank 0 and gradients from rank 2, in turn
MIDDLE = [
    Action(Kind.RECV_F, 1, 0, peer=0),
    Action(Kind.FORWARD, 1, 0),
    Action(Kind.RECV_F, 1, 1, peer=0),
    Action(Kind.RECV_B, 1, 0, peer=2),
    Action(Kind.BACKWARD, 1, 0),
]

# a V rank's lane: stages 0 and 3 of 4, both channels with the one peer (rank 1)
V_RANK = [
    Action(Kind.FORWARD, 0, 0),
    Action(Kind.RECV_F, 3, 0, peer=1),
    Action(Kind.RECV_F, 3, 1, peer=1),
    Action(Kind.RECV_B, 0, 0, peer=1),
    Action(Kind.RECV_B, 0, 1, peer=1),
]


def _run(lane: list[Action], channels_apart: bool) -> list[str]:
    transport = _Recording(channels_apart)
    inbox = Inbox(transport, lane)  # type: ignore[arg-type]  # records, moves nothing
    for action in lane:
        if action.kind in (Kind.RECV_F, Kind.RECV_B):
            inbox.take(action)
    return transport.log


@pytest.mark.parametrize("channels_apart", [False, True])
def test_each_peer_has_its_next_receive_posted_before_it_is_needed(channels_apart: bool) -> None:
    # every peer's first receive at once; a peer's next as its last is taken
    assert _run(MIDDLE, channels_apart) == [
        "post ('F', 0)@0",
        "post ('B', 1)@2",
        "wait ('F', 0)@0",
        "post ('F', 0)@0",
        "wait ('F', 0)@0",
        "wait ('B', 1)@2",
    ]


def test_one_peers_channels_are_posted_apart_where_the_transport_matches_them_apart() -> None:
    assert _run(V_RANK, channels_apart=True) == [
        "post ('F', 2)@1",
        "post ('B', 0)@1",
        "wait ('F', 2)@1",
        "post ('F', 2)@1",
        "wait ('F', 2)@1",
        "wait ('B', 0)@1",
        "post ('B', 0)@1",
        "wait ('B', 0)@1",
    ]


def test_one_peers_messages_are_received_in_one_order_where_the_transport_matches_them_so() -> None:
    assert _run(V_RANK, channels_apart=False) == [
        "post ('F', 2)@1",
        "wait ('F', 2)@1",
        "post ('F', 2)@1",
        "wait ('F', 2)@1",
        "post ('B', 0)@1",
        "wait ('B', 0)@1",
        "post ('B', 0)@1",
        "wait ('B', 0)@1",
    ]
