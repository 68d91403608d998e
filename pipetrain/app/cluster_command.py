"""``pipetrain cluster``: run a ``pipetrain train`` command as a multi-node job on an
emulated cluster of namespaced hosts with capped links (see :mod:`pipetrain.app.cluster_net`).

One ``torchrun`` per host (one worker each) meets the others through a c10d rendezvous on
the first host; gloo binds each host's capped interface. The command's own output is
printed, followed by what each host sent, from its interface's counters; with ``--json``
the command's JSON object gains a ``cluster`` entry instead. Whatever happens (success,
failure, timeout, Ctrl-C, SIGTERM, SIGHUP), the processes and the namespaces are removed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from math import inf
from typing import Any

from pipetrain.app.arguments import Parser, non_negative_float, positive_int
from pipetrain.app.cluster_net import INTERFACE, Cluster, remove_leftovers, require_root
from pipetrain.app.train_command import add_train, refuse_stages
from pipetrain.units import counted, format_bandwidth, format_bytes, parse_bandwidth

DEFAULT_PORT = 29400
SAMPLE_S = 0.25  # how often each host's sent bytes are read during the run
RATE_WINDOW_S = 1.0  # the peak send rate is taken over windows at least this long
FAILURE_GRACE_S = 10.0  # how long the other hosts may take to end after one fails
STOP_GRACE_S = 5.0  # between SIGTERM and SIGKILL of a host's processes
_TORCHRUN_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_PR_SET_PDEATHSIG = 1


def add_cluster(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "cluster",
        help="run `pipetrain train` on an emulated cluster of hosts with capped links (root)",
        description=(
            "Make HOSTS network namespaces joined to a bridge, each host's link capped to "
            "BANDWIDTH each way (tc tbf), and run the pipetrain command after -- as a "
            "multi-node torchrun job, one worker per host. Prints the command's output and "
            "the bytes each host sent. Needs root; removes everything it made when done."
        ),
        usage="pipetrain cluster --hosts N --bandwidth RATE [--json] -- train ARGS...",
    )
    parser.add_argument(
        "--hosts", type=positive_int, required=True, metavar="N", help="hosts (workers)"
    )
    parser.add_argument(
        "--bandwidth",
        type=_bandwidth,
        required=True,
        metavar="RATE",
        help="each host's link, each way, e.g. 100Mbit/s or 12.5MB/s; infB/s for no cap",
    )
    parser.add_argument(
        "--port",
        type=positive_int,
        default=DEFAULT_PORT,
        help=f"the rendezvous port on the first host (default {DEFAULT_PORT})",
    )
    parser.add_argument(
        "--timeout",
        type=non_negative_float,
        default=0.0,
        metavar="S",
        help="stop the job after S seconds and fail (default 0: no limit)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the command's JSON object (its --json is added) with a cluster entry",
    )
    parser.add_argument(
        "job", nargs=argparse.REMAINDER, metavar="-- train ARGS", help="the command to run"
    )


def _bandwidth(text: str) -> float:
    try:
        value = parse_bandwidth(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a rate above 0 (or infB/s), got {text}")
    return value


def job_arguments(args: argparse.Namespace) -> list[str]:
    """The ``pipetrain`` arguments to run on every host, parsed as ``pipetrain`` would (a
    bad one exits with status 2) and checked against the host count; ``--json`` added when
    the cluster's output is JSON."""
    job = list(args.job)
    if job[:1] == ["--"]:
        job = job[1:]
    if not job:
        raise ValueError("give the command to run after --, e.g. -- train --model mlp")
    if job[0] != "train":
        raise ValueError(
            f"a cluster runs `pipetrain train`, not {job[0]!r}; write -- train --model NAME ..."
        )
    if args.json and "--json" not in job:
        job.append("--json")
    parser = Parser(prog="pipetrain")
    add_train(parser.add_subparsers(dest="command", required=True))
    parsed = parser.parse_args(job)  # a bad argument ends here, before any host
    refuse_stages(parsed)
    if parsed.ranks is not None and parsed.ranks != args.hosts:
        raise ValueError(
            f"the job asks for --ranks {parsed.ranks} but the cluster has --hosts "
            f"{args.hosts}, one worker each; give the same number or leave out --ranks"
        )
    return job


@dataclass
class HostRun:
    """One host's ``torchrun``: its process, its output, and the bytes it sent over time."""

    index: int
    process: subprocess.Popen[str]
    stdout: list[str] = field(default_factory=list)
    samples: list[tuple[float, int]] = field(default_factory=list)
    readers: list[threading.Thread] = field(default_factory=list)

    def peak_bytes_per_s(self) -> float:
        """The highest send rate over any stretch of samples at least RATE_WINDOW_S long."""
        peak = 0.0
        for i, (start, sent) in enumerate(self.samples):
            for end, later in self.samples[i + 1 :]:
                if end - start >= RATE_WINDOW_S:
                    peak = max(peak, (later - sent) / (end - start))
                    break
        return peak


def _end_with_parent() -> None:
    """In the child, before exec: receive SIGTERM when the cluster command dies (torchrun
    then stops its worker), so a killed command leaves no job behind."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _forward(stream: Any, prefix: str, sink: list[str] | None) -> None:
    """Copy ``stream`` line by line: into ``sink``, or onto stderr with ``prefix``."""
    for line in stream:
        if sink is not None:
            sink.append(line)
        else:
            sys.stderr.write(prefix + line)
            sys.stderr.flush()


def start_hosts(cluster: Cluster, job: list[str], port: int) -> list[HostRun]:
    """Start one ``torchrun`` in each host's namespace, rendezvous on the first host."""
    endpoint = f"{cluster.hosts[0].address}:{port}"
    env = {key: value for key, value in os.environ.items() if key not in _TORCHRUN_ENV}
    env.update(GLOO_SOCKET_IFNAME=INTERFACE, TP_SOCKET_IFNAME=INTERFACE, PYTHONUNBUFFERED="1")
    runs = []
    for index, host in enumerate(cluster.hosts):
        torchrun = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(len(cluster.hosts)),
            "--nproc-per-node", "1", "--max-restarts", "0",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", cluster.name,
            # the first host serves the rendezvous (its address is not this machine's name)
            "--rdzv-conf", f"is_host={int(index == 0)}",
            "--local-addr", host.address,
            "-m", "pipetrain", *job,
        ]  # fmt: skip
        process = subprocess.Popen(
            host.command(torchrun),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            start_new_session=True,  # its own process group: Ctrl-C reaches this command only
            preexec_fn=_end_with_parent,
        )
        run = HostRun(index, process)
        for stream, sink in ((process.stdout, run.stdout), (process.stderr, None)):
            reader = threading.Thread(
                target=_forward, args=(stream, f"[h{index}] ", sink), daemon=True
            )
            reader.start()
            run.readers.append(reader)
        runs.append(run)
    return runs


def _stop(runs: list[HostRun]) -> None:
    """SIGTERM every host's process group still running, then SIGKILL what remains."""
    for signum, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
        live = [run for run in runs if run.process.poll() is None]
        for run in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.process.pid, signum)
        deadline = time.monotonic() + grace
        for run in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                run.process.wait(max(0.0, deadline - time.monotonic()))


def wait_for(cluster: Cluster, runs: list[HostRun], timeout_s: float) -> float:
    """Sample each host's sent bytes until every host's job has ended; return the wall time.
    RuntimeError if a host fails or the run passes ``timeout_s`` (0: no limit)."""
    start = time.monotonic()
    failed_at: float | None = None
    while True:
        now = time.monotonic()
        for run, host in zip(runs, cluster.hosts):
            run.samples.append((now - start, host.tx_bytes(inside=run.process.pid)))
        codes = [run.process.poll() for run in runs]
        if all(code is not None for code in codes):
            break
        bad = [i for i, code in enumerate(codes) if code not in (None, 0)]
        if bad and failed_at is None:
            failed_at = now
        if failed_at is not None and now - failed_at > FAILURE_GRACE_S:
            break
        if timeout_s and now - start > timeout_s:
            raise RuntimeError(
                f"the job ran past --timeout {timeout_s:g}s and was stopped; "
                "raise --timeout, or give 0 for no limit"
            )
        time.sleep(SAMPLE_S)
    wall = time.monotonic() - start
    _stop(runs)
    for run in runs:
        for reader in run.readers:
            reader.join(timeout=STOP_GRACE_S)
    failures = [
        f"h{run.index} (status {run.process.returncode})" for run in runs if run.process.returncode
    ]
    if failures:
        raise RuntimeError(
            f"the job failed on {', '.join(failures)}; its stderr, prefixed [h*], is above"
        )
    return wall


_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _set_handlers(handler: Any) -> dict[int, Any]:
    """Give Ctrl-C, SIGTERM and SIGHUP ``handler``; return their previous handlers."""
    return {signum: signal.signal(signum, handler) for signum in _SIGNALS}


def cluster_report(
    cluster: Cluster, runs: list[HostRun], before: list[int], after: list[int], wall_s: float
) -> dict[str, Any]:
    """The ``cluster`` entry of the JSON output: the links, and what each host sent."""
    sent = [end - start for start, end in zip(before, after)]
    return {
        "name": cluster.name,
        "hosts": len(cluster.hosts),
        # None: not capped (JSON has no infinity)
        "bandwidth_bytes_per_s": None if cluster.bytes_per_s == inf else cluster.bytes_per_s,
        "addresses": [host.address for host in cluster.hosts],
        "wall_s": wall_s,
        "bytes_sent": sent,
        "mean_bytes_per_s": [value / wall_s for value in sent],
        "peak_bytes_per_s": [run.peak_bytes_per_s() for run in runs],
    }


def _mbit(bytes_per_s: float) -> str:
    return f"{bytes_per_s * 8 / 1e6:.3g} Mbit/s"


def _summary(report: dict[str, Any]) -> str:
    lines = [
        f"cluster of {counted(report['hosts'], 'host')}, each link "
        + (
            "not capped"
            if report["bandwidth_bytes_per_s"] is None
            else f"{_mbit(report['bandwidth_bytes_per_s'])} each way"
        )
        + f", {report['wall_s']:.1f} s"
    ]
    for i, (sent, peak) in enumerate(zip(report["bytes_sent"], report["peak_bytes_per_s"])):
        lines.append(
            f"  h{i} {report['addresses'][i]:<12} sent {format_bytes(sent)}, "
            f"peak {_mbit(peak)} over {RATE_WINDOW_S:g} s"
        )
    return "\n".join(lines)


def run_cluster(args: argparse.Namespace) -> None:
    job = job_arguments(args)
    require_root()
    removed = remove_leftovers()
    if removed:
        print(f"removed {len(removed)} namespaces left by ended runs", file=sys.stderr)
    cluster = Cluster(args.hosts, args.bandwidth)
    runs: list[HostRun] = []
    # SIGTERM and SIGHUP stop the job as Ctrl-C does; during the cleanup all three are
    # ignored, so a second signal cannot cut it short
    previous = _set_handlers(_interrupt)
    try:
        cluster.create()
        print(
            f"cluster {cluster.name}: {counted(args.hosts, 'host')} at "
            f"{format_bandwidth(args.bandwidth)} each, running pipetrain {' '.join(job)}",
            file=sys.stderr,
            flush=True,
        )
        before = cluster.tx_bytes()
        runs = start_hosts(cluster, job, args.port)
        wall = wait_for(cluster, runs, args.timeout)
        report = cluster_report(cluster, runs, before, cluster.tx_bytes(), wall)
    finally:
        _set_handlers(signal.SIG_IGN)
        _stop(runs)
        cluster.destroy()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    output = "".join(line for run in runs for line in run.stdout)
    if args.json:
        lines = output.strip().splitlines()
        if not lines:
            raise RuntimeError(
                "the job printed no JSON object; its stderr, prefixed [h*], is above"
            )
        print(json.dumps({**json.loads(lines[-1]), "cluster": report}))
    else:
        print(output.rstrip("\n"))
        print(_summary(report))
