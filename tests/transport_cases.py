"""Workers for the tests of the message protocol over gloo (importable by spawned workers)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pipetrain.distributed.torch_transport import TorchTransport

# (channel, shape) in the order rank 0 sends them: two channels interleaved, each with a
# change of shapes (its header, a stale buffer, a new header) mid-way
SENT = [
    (("F", 0), (4, 3)),
    (("B", 1), (2, 5)),
    (("F", 0), (4, 3)),
    (("B", 1), (1, 5)),
    (("F", 0), (2, 3)),
    (("B", 1), (1, 5)),
]


def message(index: int) -> torch.Tensor:
    """The ``index``-th message's tensor: its shape, filled with its index."""
    return torch.full(SENT[index][1], float(index))


def channels_received_out_of_sent_order() -> tuple[bool, list[tuple[int, list[int]]]]:
    """Rank 0 sends :data:`SENT`; rank 1 posts the first receive of each channel at once,
    then takes every message of channel ``B`` before any of ``F`` (posting a channel's next
    receive as it takes one). Rank 1 returns whether its transport matches channels apart,
    and each received tensor's value and shape in the order taken."""
    transport = TorchTransport(torch.device("cpu"), timeout_s=60)
    if dist.get_rank() == 0:
        for index, (channel, _) in enumerate(SENT):
            transport.send((message(index),), 1, channel)
        transport.flush()
        return transport.channels_apart, []
    channels = (("F", 0), ("B", 1))
    posted = {channel: transport.post_receive(0, channel) for channel in channels}
    received = []
    for channel in reversed(channels):
        left = sum(1 for sent, _ in SENT if sent == channel)
        while left:
            (tensor,) = posted.pop(channel).wait()
            left -= 1
            if left:
                posted[channel] = transport.post_receive(0, channel)
            received.append((int(tensor.flatten()[0]), list(tensor.shape)))
    return transport.channels_apart, received


def yields_per_send() -> tuple[int, int]:
    """Rank 0 sends two messages on one channel (header and data, then data) and counts
    the times its transport yielded the core and the buffers it posted; rank 1 receives
    them and returns 0 and 0."""
    transport = TorchTransport(torch.device("cpu"), timeout_s=60)
    if dist.get_rank() == 1:
        for _ in range(2):
            transport.receive(0, ("F", 0))
        return 0, 0
    yields = []
    transport._yield = lambda: yields.append(1)
    for _ in range(2):
        transport.send((torch.ones(3),), 1, ("F", 0))
    posted = len(transport._pending_sends)
    transport.flush()
    return len(yields), posted


def yields_before_computing() -> tuple[int, int]:
    """Rank 0 sends a message that rank 1 does not receive until both pass a barrier, and
    asks its transport to yield to its sends before and after the message has gone. Rank 0
    returns the yields each request made (0 and 0 on rank 1)."""
    transport = TorchTransport(torch.device("cpu"), timeout_s=60)
    if dist.get_rank() == 1:
        dist.barrier()
        transport.receive(0, ("F", 0))
        return 0, 0
    yields = []
    transport._yield = lambda: yields.append(1)
    transport.send((torch.ones(3),), 1, ("F", 0))
    posted = len(yields)
    transport.yield_to_sends()  # under way: gloo sends only into a posted receive
    under_way = len(yields) - posted
    dist.barrier()
    transport.flush()
    transport.yield_to_sends()  # gone
    return under_way, len(yields) - posted - under_way
