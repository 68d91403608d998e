"""Bytes each worker's host sent over its network while training, from the kernel's counters.

A worker reads the counters of the network namespace it runs in: on an emulated cluster
(``pipetrain cluster``) each host's own link, so the training loop's traffic can be told
from the planning and profiling before it. Loopback is left out: local workers on one
machine send nothing over a network.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_COUNTERS = "/proc/net/dev"
_TRANSMITTED_BYTES = 8  # the first transmit column, after 8 receive columns


def interface_bytes_sent() -> int:
    """Bytes sent so far by the network interfaces of this process's namespace, loopback
    left out (0 where the counters cannot be read)."""
    try:
        with open(_COUNTERS) as table:
            lines = table.readlines()[2:]  # after the two header lines
    except OSError:
        return 0
    total = 0
    for line in lines:
        name, _, counters = line.partition(":")
        if name.strip() != "lo":
            total += int(counters.split()[_TRANSMITTED_BYTES])
    return total


def sent_since(start: int) -> list[int]:
    """Call on every rank of the default process group: each rank's bytes sent since its
    :func:`interface_bytes_sent` was ``start``, in rank order, on every rank."""
    mine = torch.tensor([interface_bytes_sent() - start], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [int(sent) for sent in everyone]
