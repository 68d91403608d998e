"""Workers for the store tests (importable by spawned workers): the sockets a process
listens on, and runs whose store holds keys that no rank wrote."""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from contextlib import suppress
from pathlib import Path

import launch_cases
import pipeline_cases
import torch
import torch.distributed as dist

from pipetrain.distributed.store import LOOPBACK
from pipetrain.distributed.torch_transport import TorchTransport

_LISTEN = "0A"  # the state column of /proc/net/tcp


def _endpoint(hex_endpoint: str) -> tuple[str, int]:
    """``/proc/net/tcp``'s ``ADDRESS:PORT`` (hex; the address in host byte order by 32-bit
    word) as an address and a port."""
    address, port = hex_endpoint.split(":")
    packed = bytes.fromhex(address)
    words = b"".join(packed[i : i + 4][::-1] for i in range(0, len(packed), 4))
    return str(ipaddress.ip_address(words)), int(port, 16)


def _listening(pid: int) -> list[tuple[str, int]]:
    """The TCP endpoints process ``pid`` listens on (Linux: reads /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == _LISTEN and fields[9] in inodes:
                found.append(_endpoint(fields[1]))
    return found


def listening(pid: int) -> list[str]:
    """The addresses of the TCP sockets process ``pid`` listens on."""
    return [address for address, _ in _listening(pid)]


def listening_ports(pid: int) -> list[int]:
    """The ports of the TCP sockets process ``pid`` listens on."""
    return [port for _, port in _listening(pid)]


def listeners_of_the_job() -> dict[str, list[str]]:
    """The addresses this worker and its launcher listen on, once every worker has joined."""
    dist.barrier()  # every worker's gloo sockets are open
    return {"worker": listening(os.getpid()), "launcher": listening(os.getppid())}


PLANTED = "unsigned\n1\nNone\ninjected: rank 1 ran out of coffee"


def planted_failure_record(ranks: int) -> str:
    """Rank 0 writes a well-formed but unsigned failure record to the store before the
    pipeline's last rank fails for real; each rank returns the error it raised."""
    if dist.get_rank() == 0:
        dist.distributed_c10d._get_default_store().set("pipetrain/first_failure", PLANTED)
    dist.barrier()
    return pipeline_cases.failing_step_messages(ranks)


def planted_heartbeat(delay_s: float) -> float:
    """Rank 0 writes a value that is no counter over rank 1's heartbeat, then waits
    ``delay_s`` for rank 1's message (see :func:`launch_cases.slow_peer`)."""
    transport = TorchTransport(torch.device("cpu"), timeout_s=60, frozen_after_s=1.5)
    if dist.get_rank() == 0:
        dist.distributed_c10d._get_default_store().set("pipetrain/heartbeat/1", "stuck")
    return launch_cases.slow_peer_on(transport, delay_s)


def poked_job(pause_s: float) -> str:
    """Start every worker's heartbeat, wait ``pause_s`` (while a test pokes the store), then
    meet the other workers once more: the job must still work."""
    TorchTransport(torch.device("cpu"), timeout_s=60)
    time.sleep(pause_s)
    dist.barrier()
    return "ok"


def poke(port: int, seconds: float) -> int:
    """Connect to ``port`` again and again for ``seconds``, each time sending random bytes;
    return how many connections were made."""
    made, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        with suppress(OSError), socket.create_connection((LOOPBACK, port), timeout=1) as link:
            link.sendall(os.urandom(64))
            made += 1
    return made
