"""What a message between two workers costs their cores, measured as the pipeline sends it.

A send keeps its process busy packing the message and handing its bytes to the transport;
a receive, copying them in. On one machine's shared cores the kernel moves the bytes on
those same cores, so the cost grows with the message: in an emulated cluster's plan jobs,
0.2-0.3 ms a message, and 0.3-0.7 ms more a MB on the sender and 0.2 on the receiver over
uncapped links, 1.0-1.3 and 1.6-2.0 over 100 Mbit/s ones (whose bytes arrive paced, a few
at a time). Both sides are timed in CPU time (every thread of the process: a transport's
own threads move bytes too), so time spent waiting for the message or for a core does not
count, while the other ranks compute as they would in training.
"""

from __future__ import annotations

import statistics
import time
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist

from pipetrain.distributed.torch_transport import TorchTransport
from pipetrain.profiler.links import SMALL_BYTES, busy_until, past


class MessageCosts(NamedTuple):
    """A message's CPU seconds, each side's: ``fixed_s`` the longer of the sender's and the
    receiver's for a message of a few bytes, ``send_byte_s`` and ``receive_byte_s`` what
    each byte more adds on that side."""

    fixed_s: float
    send_byte_s: float
    receive_byte_s: float


def measure_message_costs(
    large_bytes: int, bandwidth: float, rounds: int = 24, warmup: int = 4
) -> MessageCosts:
    """Call on every rank of the default process group (gloo, two ranks or more): rank 0
    sends rank 1 messages of :data:`SMALL_BYTES` and of ``large_bytes`` through the
    pipeline's transport, the other ranks computing meanwhile, and every rank returns the
    costs of the medians of ``rounds`` of each (after ``warmup``). ``bandwidth`` (bytes/s,
    the links measured) sets how long the others compute each round."""
    rank = dist.get_rank()
    transport = TorchTransport(torch.device("cpu"))
    large = max(large_bytes, 2 * SMALL_BYTES)
    medians = []
    for nbytes in (SMALL_BYTES, large):
        busy_s = 0.005 + 3 * nbytes / bandwidth  # longer than the message takes to cross
        payload = (torch.zeros(max(1, nbytes // 4)),)
        spent = []
        for _ in range(warmup + rounds):
            dist.barrier()
            start = time.process_time()
            if rank == 0:
                transport.send(payload, 1, "message")
                transport.flush()
            elif rank == 1:
                transport.post_receive(0, "message").wait()
            else:
                busy_until(partial(past, time.perf_counter() + busy_s))
            spent.append(time.process_time() - start)
        medians.append(statistics.median(spent[warmup:]))
    # rank 0's (send) and rank 1's (receive): small, large
    sides = torch.zeros(2, 2, dtype=torch.float64)
    if rank < 2:
        sides[rank] = torch.tensor(medians, dtype=torch.float64)
    dist.all_reduce(sides)
    extra = large - SMALL_BYTES
    (send_small, send_large), (receive_small, receive_large) = sides.tolist()
    return MessageCosts(
        max(send_small, receive_small),
        max(0.0, send_large - send_small) / extra,
        max(0.0, receive_large - receive_small) / extra,
    )
