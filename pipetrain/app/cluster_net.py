"""An emulated cluster on this machine: hosts as network namespaces, one bandwidth cap each.

:class:`Cluster` makes, for one run, a switch namespace holding a bridge and ``hosts``
namespaces, each joined to the bridge by a veth pair. Each host's interface
(:data:`INTERFACE`) has an address in 198.18.0.0/24 (the benchmarking range, used only
inside these namespaces) and a token-bucket filter (``tc ... tbf``) capping what it sends;
its switch port has the same cap on what it receives. Every link lives inside a namespace
of the run, so deleting the run's namespaces removes links, qdiscs and addresses at once.

Names carry the creating process's id and a random token (``ptc<pid>-<token>-h0``), so
parallel runs never collide, and :func:`remove_leftovers` can remove what a run that died
without cleaning up left behind while leaving the namespaces of live runs alone.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass

PREFIX = "ptc"
"""The start of every namespace name a cluster makes."""
INTERFACE = "eth0"
"""A host's interface, the one gloo binds (``GLOO_SOCKET_IFNAME``)."""
NETWORK = "198.18.0"
"""Hosts are 198.18.0.1, 198.18.0.2, ... (/24), inside the run's own namespaces only."""
MAX_HOSTS = 250
MIN_BURST_BYTES = 128 * 1024  # at least two 64 KiB segments, or tbf drops large packets
BURST_S = 0.004  # a bucket of 4 ms at the capped rate, when that is larger
# A second bucket of two full frames, refilled slightly above the rate, paces every packet:
# without it a message smaller than the first bucket crosses at the veth's speed
# (32 KiB at 90 MB/s under a 12.5 MB/s cap), which no real link of that speed does.
PEAK_RATE_FACTOR = 1.05
PEAK_BUCKET_BYTES = 3200
QUEUE_LATENCY = "100ms"
_COMMAND_TIMEOUT_S = 30
_NAME = re.compile(rf"^{PREFIX}(?P<pid>\d+)-[0-9a-f]+-(sw|h\d+)$")


def require_root() -> None:
    """Raise a ValueError, in one line, unless this process can make network namespaces."""
    if os.geteuid() != 0:
        raise ValueError(
            "an emulated cluster makes network namespaces, which needs root; "
            "run it as root (e.g. with sudo)"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ValueError(
            f"an emulated cluster needs the {' and '.join(missing)} command (iproute2); "
            "install iproute2"
        )


def _run(*command: str) -> str:
    """Run an ``ip``/``tc`` command; RuntimeError naming it and its error if it fails."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed: {done.stderr.strip()}")
    return done.stdout


def namespaces() -> list[str]:
    """The names of this machine's network namespaces."""
    listed = _run("ip", "netns", "list")
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def _kill_processes_in(namespace: str) -> None:
    """SIGKILL every process still running in ``namespace``."""
    listed = subprocess.run(
        ("ip", "netns", "pids", namespace),
        capture_output=True,
        text=True,
        timeout=_COMMAND_TIMEOUT_S,
    )
    for pid in listed.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def _delete(namespace: str) -> None:
    """End the processes in ``namespace``, then delete it (and the links inside it)."""
    _kill_processes_in(namespace)
    subprocess.run(
        ("ip", "netns", "delete", namespace),
        capture_output=True,
        timeout=_COMMAND_TIMEOUT_S,
    )


def _alive_run(pid: int) -> bool:
    """Whether process ``pid`` exists and is a pipetrain command (a live run)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return b"pipetrain" in cmdline.read()
    except OSError:
        return False


def remove_leftovers() -> list[str]:
    """Delete the namespaces (and their processes) of runs whose process has died; return
    their names. Namespaces of live runs and every other namespace are left alone."""
    removed = []
    for name in namespaces():
        match = _NAME.match(name)
        if match is not None and not _alive_run(int(match["pid"])):
            _delete(name)
            removed.append(name)
    return removed


@dataclass(frozen=True)
class Host:
    """One emulated host: its namespace and its interface's address."""

    namespace: str
    address: str

    def tx_bytes(self, inside: int | None = None) -> int:
        """Bytes sent so far by this host's interface (its kernel counter). ``inside``, the
        id of a process running in the host's namespace, lets it read that process's
        ``/proc/<pid>/net/dev`` instead of starting one in the namespace; if that process
        has ended, the counter is read the usual way."""
        if inside is not None:
            try:
                with open(f"/proc/{inside}/net/dev") as table:
                    for line in table:
                        name, _, counters = line.partition(":")
                        if name.strip() == INTERFACE:
                            return int(counters.split()[8])  # after 8 receive counters
            except OSError:
                pass  # the process has ended
        path = f"/sys/class/net/{INTERFACE}/statistics/tx_bytes"
        return int(_run("ip", "netns", "exec", self.namespace, "cat", path))

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


class Cluster:
    """``hosts`` namespaced hosts on one bridge, each link capped at ``bytes_per_s`` in each
    direction (``inf``: not capped, as fast as the kernel's veth pairs go). A context
    manager: entering makes it (removing what it made if that fails part way), leaving
    deletes it, with every process still running inside."""

    def __init__(self, hosts: int, bytes_per_s: float) -> None:
        """Describe the cluster; nothing is made before :meth:`create` (or ``with``)."""
        if not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be between 1 and {MAX_HOSTS}, got {hosts}")
        if not bytes_per_s > 0:
            raise ValueError(
                f"a cluster's links need a positive bandwidth, got {bytes_per_s} B/s; "
                "give one like 100Mbit/s (or inf for no cap)"
            )
        self.bytes_per_s = bytes_per_s
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{self.name}-sw"
        self.hosts = [Host(f"{self.name}-h{i}", f"{NETWORK}.{i + 1}") for i in range(hosts)]
        self._made: list[str] = []

    def __enter__(self) -> Cluster:
        self.create()
        return self

    def __exit__(self, *_: object) -> None:
        self.destroy()

    def _tbf(self, namespace: str, device: str) -> None:
        rate_bits = max(8, round(self.bytes_per_s * 8))
        burst = max(MIN_BURST_BYTES, round(self.bytes_per_s * BURST_S))
        _run(
            "tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf",
            "rate", f"{rate_bits}bit", "burst", str(burst), "latency", QUEUE_LATENCY,
            "peakrate", f"{round(rate_bits * PEAK_RATE_FACTOR)}bit",
            "mtu", str(PEAK_BUCKET_BYTES),
        )  # fmt: skip

    def create(self) -> None:
        """Make the switch, the hosts and their capped links."""
        try:
            _run("ip", "netns", "add", self.switch)
            self._made.append(self.switch)
            _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", "br0", "up")
            for i, host in enumerate(self.hosts):
                _run("ip", "netns", "add", host.namespace)
                self._made.append(host.namespace)
                port = f"p{i}"
                _run(
                    "ip", "-n", self.switch, "link", "add", port, "type", "veth",
                    "peer", "name", INTERFACE, "netns", host.namespace,
                )  # fmt: skip
                _run("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
                _run("ip", "-n", host.namespace, "link", "set", "lo", "up")
                address = f"{host.address}/24"
                _run("ip", "-n", host.namespace, "addr", "add", address, "dev", INTERFACE)
                _run("ip", "-n", host.namespace, "link", "set", INTERFACE, "up")
                if self.bytes_per_s != float("inf"):
                    self._tbf(host.namespace, INTERFACE)  # what the host sends
                    self._tbf(self.switch, port)  # what it receives
        except BaseException:
            self.destroy()
            raise

    def destroy(self) -> None:
        """Delete every namespace this cluster made, ending the processes inside first."""
        for namespace in reversed(self._made):
            _delete(namespace)
        self._made.clear()

    def tx_bytes(self) -> list[int]:
        """Bytes each host has sent so far, in host order."""
        return [host.tx_bytes() for host in self.hosts]
