"""``pipetrain cluster``: namespaced hosts with capped links, a 2-node torchrun pipeline over
them that trains exactly, and nothing left behind after success or Ctrl-C.

Tests that make namespaces skip, with the reason, where that is impossible (not root, no
iproute2, no network namespaces).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_cli import ROOT, unpipelined_losses

from pipetrain.app import cli
from pipetrain.app.cluster_net import MIN_BURST_BYTES, Cluster, namespaces
from pipetrain.planning import Topology

CAP = 50e6 / 8  # 50 Mbit/s in bytes/s
PAYLOAD = 4_000_000  # bytes sent through a capped link: about 0.64 s at 50 Mbit/s
JOB_TIMEOUT_S = 100


def _namespaces_unavailable() -> str | None:
    """Why this machine cannot make network namespaces here, or ``None``."""
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    try:
        with Cluster(1, CAP):
            pass
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:
        return f"cannot make a namespaced host here: {error}"
    return None


_REASON = _namespaces_unavailable()
needs_namespaces = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def _root_links() -> set[str]:
    """The link names of this machine's own network namespace."""
    listed = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True)
    return {line.split(":")[1].strip() for line in listed.stdout.splitlines()}


def _processes_naming(text: str) -> list[int]:
    """The processes whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


@pytest.fixture
def runs() -> Iterator[list[str]]:
    """The names of the clusters a test made (it appends them); afterwards, check that none
    left a namespace, a process, or a link in this machine's own namespace."""
    links, names = _root_links(), list[str]()
    yield names
    assert names
    for name in names:
        assert [ns for ns in namespaces() if ns.startswith(name)] == []
        assert _processes_naming(name) == []
    made_here = {link for link in _root_links() - links if link == "br0" or link[:1] == "p"}
    assert made_here == set()


def start_cluster(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.Popen(
        [sys.executable, "-m", "pipetrain", "cluster", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )


def finish(process: subprocess.Popen[str], timeout_s: float) -> tuple[str, str]:
    """The process's output once it ends; past ``timeout_s`` it is interrupted (and so
    cleans up) and the test fails."""
    try:
        return process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)
        err = process.communicate(timeout=30)[1]
        pytest.fail(f"the cluster command ran past {timeout_s} s: {failure(err)}")


_CAUSES = ("terminate called", "what():", "Fatal Python error", "Traceback", "Error", "error")


def failure(err: str) -> str:
    """What a failed cluster run printed: each host's lines that name a cause (an uncaught
    C++ exception, a fatal signal's Python stacks, a traceback, an error), which the other
    hosts' later complaints would push out of a plain tail, then the tail (native stack
    frames left out)."""
    lines = [line[:300] for line in err.splitlines() if "frame #" not in line]
    causes = [n for n, line in enumerate(lines) if any(cause in line for cause in _CAUSES)]
    # a cause with the lines after it: the exception's message, the stacks below the signal
    shown = sorted({n for first in causes[:12] for n in range(first, min(first + 8, len(lines)))})
    return "\n".join([*(lines[n] for n in shown[:120]), "...", *lines[-20:]])


def ended_with(process: subprocess.Popen[str], err: str, code: int = 0) -> None:
    """Fail the test, with :func:`failure`'s account in full, unless ``process`` exited
    with ``code``."""
    if process.returncode != code:
        pytest.fail(f"the cluster command exited with {process.returncode}:\n{failure(err)}")


def test_without_root_it_says_so_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    args = ["cluster", "--hosts", "2", "--bandwidth", "50Mbit/s", "--", "train", "--model", "mlp"]
    assert cli.main(args) == 2
    stderr = capsys.readouterr().err
    assert "needs root" in stderr and len(stderr.strip().splitlines()) == 1, stderr


@pytest.mark.parametrize(
    "job, named",
    [
        (["plan"], "runs `pipetrain train`, not 'plan'"),
        (["train", "--model", "mlp", "--ranks", "3"], "--ranks 3 but the cluster has --hosts 2"),
        ([], "give the command to run after --"),
    ],
)
def test_it_runs_a_train_job_that_fits_the_hosts(
    capsys: pytest.CaptureFixture[str], job: list[str], named: str
) -> None:
    # refused before any namespace is made
    assert cli.main(["cluster", "--hosts", "2", "--bandwidth", "1Gbit/s", "--", *job]) == 2
    stderr = capsys.readouterr().err
    assert named in stderr and len(stderr.strip().splitlines()) == 1, stderr


@needs_namespaces
def test_a_host_link_sends_no_faster_than_its_cap(runs: list[str]) -> None:
    receive = (
        "import socket; s = socket.socket(); s.bind(('0.0.0.0', 5001)); s.listen(); "
        "c, _ = s.accept(); n = 0\n"
        "while (d := c.recv(1 << 16)): n += len(d)\n"
        "print(n)"
    )
    with Cluster(2, CAP) as cluster:
        runs.append(cluster.name)
        server, client = cluster.hosts
        receiver = subprocess.Popen(
            server.command([sys.executable, "-c", receive]), stdout=subprocess.PIPE, text=True
        )
        send = (
            "import socket, time; "
            f"s = socket.create_connection(('{server.address}', 5001), timeout=20); "
            f"t = time.perf_counter(); s.sendall(bytes({PAYLOAD})); s.shutdown(socket.SHUT_WR); "
            "s.recv(1); print(time.perf_counter() - t)"
        )
        before = client.tx_bytes()
        for _ in range(50):  # until the receiver listens
            sent = subprocess.run(
                client.command([sys.executable, "-c", send]),
                capture_output=True,
                text=True,
                timeout=30,
            )
            if sent.returncode == 0:
                break
            time.sleep(0.1)
        assert sent.returncode == 0, sent.stderr
        received = receiver.communicate(timeout=30)[0]
        elapsed = float(sent.stdout)
        sent_bytes = client.tx_bytes() - before
    assert int(received) == PAYLOAD
    assert sent_bytes >= PAYLOAD  # the interface counter saw the payload and its headers
    # the bucket may start full: at most one burst above the capped rate
    assert sent_bytes <= CAP * elapsed + MIN_BURST_BYTES * 2


SHORT = 32 * 1024  # a message well inside the token bucket


@needs_namespaces
def test_a_short_message_after_a_pause_crosses_no_faster_than_the_cap(runs: list[str]) -> None:
    # each round: the bucket refills during a pause, then one short message and its reply
    echo = (
        "import socket; s = socket.socket(); s.bind(('0.0.0.0', 5002)); s.listen(); "
        "c, _ = s.accept()\n"
        "while True:\n"
        "    n = 0\n"
        f"    while n < {SHORT}:\n"
        f"        d = c.recv({SHORT} - n)\n"
        "        if not d: raise SystemExit\n"
        "        n += len(d)\n"
        "    c.sendall(b'k')"
    )
    send = (
        "import socket, statistics, time\n"
        "for _ in range(50):\n"
        "    try: s = socket.create_connection(('{address}', 5002), timeout=20); break\n"
        "    except OSError: time.sleep(0.1)\n"
        "s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); times = []\n"
        "for _ in range(7):\n"
        "    time.sleep(0.05); t = time.perf_counter()\n"
        f"    s.sendall(bytes({SHORT})); s.recv(1); times.append(time.perf_counter() - t)\n"
        "print(statistics.median(times))"
    )
    with Cluster(2, CAP) as cluster:
        runs.append(cluster.name)
        server, client = cluster.hosts
        receiver = subprocess.Popen(server.command([sys.executable, "-c", echo]))
        sent = subprocess.run(
            client.command([sys.executable, "-c", send.format(address=server.address)]),
            capture_output=True,
            text=True,
            timeout=60,
        )
        receiver.kill()
        receiver.wait(timeout=10)
    assert sent.returncode == 0, sent.stderr
    # a bucket that passed it at once would take well under a millisecond
    assert float(sent.stdout) >= 0.8 * SHORT / CAP


@needs_namespaces
def test_an_uncapped_cluster_has_no_token_bucket(runs: list[str]) -> None:
    with Cluster(2, math.inf) as uncapped, Cluster(1, CAP) as capped:
        runs += [uncapped.name, capped.name]
        shown = [
            subprocess.run(
                ["tc", "-n", host.namespace, "qdisc", "show", "dev", "eth0"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            for host in (*uncapped.hosts, *capped.hosts)
        ]
    assert ["tbf" in qdisc for qdisc in shown] == [False, False, True]


@pytest.mark.slow
@needs_namespaces
def test_a_two_host_pipeline_trains_exactly_within_the_cap(runs: list[str]) -> None:
    process = start_cluster(
        "--hosts", "2", "--bandwidth", "50Mbit/s", "--json", "--timeout", str(JOB_TIMEOUT_S),
        "--", "train", "--model", "mlp", "--steps", "3", "--microbatches", "2",
    )  # fmt: skip
    runs.append(f"ptc{process.pid}-")
    out, err = finish(process, JOB_TIMEOUT_S + 20)
    ended_with(process, err)
    report = json.loads(out)
    assert report["ranks"] == 2 and report["schedule"] == "1f1b"
    assert report["losses"] == pytest.approx(
        unpipelined_losses("mlp", 3, report["batch_size"]), rel=1e-5
    )
    cluster = report["cluster"]
    assert cluster["addresses"] == ["198.18.0.1", "198.18.0.2"]
    assert cluster["bandwidth_bytes_per_s"] == CAP
    # each host sent its activations or gradients (more than a step's worth of floats)
    assert all(sent > 64 * 4 for sent in cluster["bytes_sent"])
    assert all(sent <= CAP * cluster["wall_s"] for sent in cluster["bytes_sent"])
    burst_per_window = 2 * MIN_BURST_BYTES  # tbf may pass a burst on top of the rate
    assert all(peak <= CAP + burst_per_window for peak in cluster["peak_bytes_per_s"])


@pytest.mark.slow
@needs_namespaces
def test_sharded_replicas_on_four_hosts_train_exactly_and_leave_nothing(runs: list[str]) -> None:
    process = start_cluster(
        "--hosts", "4", "--bandwidth", "50Mbit/s", "--json", "--timeout", str(JOB_TIMEOUT_S),
        "--", "train", "--model", "mlp", "--steps", "3", "--microbatches", "2",
        "--data-parallel", "2", "--shard",
    )  # fmt: skip
    runs.append(f"ptc{process.pid}-")
    out, err = finish(process, JOB_TIMEOUT_S + 20)
    ended_with(process, err)
    report = json.loads(out)
    assert (report["ranks"], report["stages"], report["data_parallel"], report["shard"]) == (
        4,
        2,
        2,
        True,
    )
    assert report["losses"] == pytest.approx(
        unpipelined_losses("mlp", 3, report["batch_size"]), rel=1e-5
    )
    # every host's replica gathered its stage and reduce-scattered its gradients over the link
    assert all(sent > 64 * 4 for sent in report["cluster"]["bytes_sent"])


@pytest.mark.slow
@needs_namespaces
def test_an_automatic_plan_measures_the_capped_link(runs: list[str]) -> None:
    process = start_cluster(
        "--hosts", "2", "--bandwidth", "50Mbit/s", "--json", "--timeout", str(JOB_TIMEOUT_S),
        "--", "train", "--model", "mlp", "--steps", "2", "--plan", "auto",
    )  # fmt: skip
    runs.append(f"ptc{process.pid}-")
    out, err = finish(process, JOB_TIMEOUT_S + 20)
    ended_with(process, err)
    report = json.loads(out)
    [level] = Topology.parse(report["planned_topology"]).levels
    assert level.count == 2
    # gloo moves about 95% of a capped link's rate; a burst may pass on top of it
    assert 0.85 * CAP < level.bandwidth < 1.1 * CAP
    assert 0 < level.latency_s < 0.05
    assert report["planned_step_s"] > 0


@pytest.mark.slow
@needs_namespaces
def test_ctrl_c_stops_the_job_and_removes_the_cluster(runs: list[str]) -> None:
    process = start_cluster(
        "--hosts", "2", "--bandwidth", "50Mbit/s", "--timeout", str(JOB_TIMEOUT_S),
        "--", "train", "--model", "mlp", "--steps", "500",
    )  # fmt: skip
    runs.append(f"ptc{process.pid}-")
    assert process.stderr is not None
    deadline = time.monotonic() + JOB_TIMEOUT_S
    for line in process.stderr:  # interrupt once training is under way (at step 50)
        if "step " in line or time.monotonic() > deadline:
            break
    process.send_signal(signal.SIGINT)
    _, err = finish(process, 60)
    ended_with(process, err, 130)
    assert err.strip().splitlines()[-1] == "pipetrain cluster: interrupted"


@pytest.mark.slow
@needs_namespaces
def test_ddp_over_two_hosts_trains_exactly_and_sends_its_gradients(runs: list[str]) -> None:
    from pipetrain.app.models import build_model

    steps = 3
    process = start_cluster(
        "--hosts", "2", "--bandwidth", "50Mbit/s", "--json", "--timeout", str(JOB_TIMEOUT_S),
        "--", "train", "--model", "mlp", "--ddp", "--steps", str(steps),
    )  # fmt: skip
    runs.append(f"ptc{process.pid}-")
    out, err = finish(process, JOB_TIMEOUT_S + 20)
    ended_with(process, err)
    report = json.loads(out)
    assert report["schedule"] == "ddp" and report["ranks"] == 2
    assert report["losses"] == pytest.approx(
        unpipelined_losses("mlp", steps, report["batch_size"]), rel=1e-5
    )
    # averaging a gradient over 2 hosts, each must send at least half of it every step
    gradient_bytes = 4 * sum(p.numel() for p in build_model("mlp").parameters())
    cluster = report["cluster"]
    assert all(sent >= steps * gradient_bytes / 2 for sent in cluster["bytes_sent"])
    assert all(sent <= CAP * cluster["wall_s"] for sent in cluster["bytes_sent"])
    # the training loop's own traffic, counted by each worker in its host's namespace: the
    # gradients, and no more than the whole run's
    training = report["training_bytes_sent"]
    assert all(sent >= steps * gradient_bytes / 2 for sent in training)
    assert all(t <= whole for t, whole in zip(training, cluster["bytes_sent"]))
