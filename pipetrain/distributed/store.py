"""Where pipetrain's processes listen: the key-value store and gloo's sockets.

A ``torch.distributed.TCPStore`` server binds every address of its host by default, and its
keys decide which rank pipetrain names as a failure's origin. Here the store listens on a
socket pipetrain binds itself: on loopback for a run on one host (:func:`local_store`, and
:func:`join_group` when ``MASTER_ADDR`` is a loopback address), on ``MASTER_ADDR``'s own
address for a run across hosts. Gloo's sockets follow: loopback for a run on one host
(``GLOO_SOCKET_IFNAME`` set to the loopback interface), the interface the user gives
(``GLOO_SOCKET_IFNAME``) across hosts.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta

import torch.distributed as dist

LOOPBACK = "127.0.0.1"
_BACKLOG = 1024  # pending connections: every worker connects at start


def loopback_interface() -> str:
    """The name of this host's loopback network interface (``lo`` on Linux)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((name for name in ("lo", "lo0") if name in names), "lo")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) resolves to a loopback address."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def keep_gloo_on_loopback() -> None:
    """Have gloo (and NCCL's bootstrap) listen on the loopback interface only: for processes
    that all run on this host."""
    interface = loopback_interface()
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    os.environ["NCCL_SOCKET_IFNAME"] = interface


def _listening_socket(host: str, port: int) -> tuple[int, int]:
    """A socket listening on ``host``'s address at ``port`` (0: a free one), as a file
    descriptor for a store to own, and its port."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(_BACKLOG)
        bound = listener.getsockname()[1]
    except OSError:
        listener.close()
        raise
    return listener.detach(), bound


def server_store(host: str, port: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """A store server listening only on ``host``'s address at ``port`` (0: a free one)."""
    descriptor, bound = _listening_socket(host, port)
    return dist.TCPStore(
        host,
        bound,
        world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=descriptor,
    )


def local_store(world_size: int, timeout: timedelta) -> dist.TCPStore:
    """A store server for workers on this host: it listens on loopback only."""
    return server_store(LOOPBACK, 0, world_size, timeout)


def join_group(backend: str, timeout: timedelta) -> None:
    """Join the process group that ``torchrun`` (or any launcher setting ``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE``) describes, listening only where needed.

    With ``MASTER_ADDR`` a loopback address every process runs on this host, so gloo stays
    on loopback. Rank 0 hosts the store only when the launcher's agent does not
    (``TORCHELASTIC_USE_AGENT_STORE``), and then binds it to ``MASTER_ADDR``'s address, not
    every one of the host's.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if is_loopback(host):
        keep_gloo_on_loopback()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        dist.init_process_group(backend, timeout=timeout)
        return
    # every rank hands its store over itself, so all see the same keys (env:// would prefix)
    store = (
        server_store(host, port, world_size, timeout)
        if rank == 0
        else dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    )
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
