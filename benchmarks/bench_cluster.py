"""Data parallelism against the planner's pipeline on an emulated cluster of capped links.

Needs root (``pipetrain cluster`` makes network namespaces). For each ``--bandwidth``:

1. makes a 2-host cluster and measures the bandwidth between its hosts (one TCP stream of
   ``PROBE_BYTES`` through the capped link);
2. profiles the model in one process (``pipetrain profile``) and plans it for ``--hosts``
   workers on a one-level topology of that measured bandwidth (``pipetrain plan
   --topology Nx<measured>``);
3. trains it on ``--hosts`` namespaced hosts twice, as ``pipetrain cluster -- train``:
   with ``--ddp``, and with ``--plan`` (the planned split, replication, schedule and
   micro-batches), each evaluating on the held-out batch every ``--eval-every`` steps.

It prints, per configuration: the time to reach ``--target-loss`` on the held-out batch
(the summed step times up to the first evaluation at or below it; evaluation time left
out) and the steps that took (statistical efficiency), samples/s at the median step, the
bytes each host sent (interface counters), and the planner's predicted step time beside
the measured median (DDP has no prediction).

    sudo python benchmarks/bench_cluster.py [--model uneven-mlp] [--hosts 2]
        [--bandwidth 100Mbit/s ...] [--steps 40] [--eval-every 5] [--target-loss 1.0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pipetrain.app.cluster_net import Cluster, require_root
from pipetrain.units import parse_bandwidth

ROOT = Path(__file__).resolve().parent.parent
PROBE_BYTES = 8_000_000
PROBE_PORT = 5001
_RECEIVE = (
    "import socket; s = socket.socket(); s.bind(('0.0.0.0', {port})); s.listen(); "
    "c, _ = s.accept(); n = 0\n"
    "while (d := c.recv(1 << 16)): n += len(d)\n"
    "c.sendall(b'.'); print(n)"
)
_SEND = (
    "import socket, time; s = socket.create_connection(('{address}', {port}), timeout=30); "
    "t = time.perf_counter(); s.sendall(bytes({size})); s.shutdown(socket.SHUT_WR); "
    "s.recv(1); print(time.perf_counter() - t)"
)


def measured_bandwidth(cap: float) -> float:
    """Bytes/s one TCP stream moves between two hosts whose links are capped at ``cap``."""
    with Cluster(2, cap) as cluster:
        server, client = cluster.hosts
        receiver = subprocess.Popen(
            server.command([sys.executable, "-c", _RECEIVE.format(port=PROBE_PORT)]),
            stdout=subprocess.PIPE,
            text=True,
        )
        send = _SEND.format(address=server.address, port=PROBE_PORT, size=PROBE_BYTES)
        for _ in range(50):  # until the receiver listens
            sent = subprocess.run(
                client.command([sys.executable, "-c", send]),
                capture_output=True,
                text=True,
                timeout=120,
            )
            if sent.returncode == 0:
                break
            time.sleep(0.1)
        receiver.communicate(timeout=30)
        if sent.returncode != 0:
            raise RuntimeError(f"the bandwidth probe failed: {sent.stderr.strip()}")
        return PROBE_BYTES / float(sent.stdout)


def pipetrain(*args: str, timeout_s: float = 1800) -> str:
    """Run ``python -m pipetrain ARGS``; its stdout, or RuntimeError with its stderr's end."""
    env = {key: value for key, value in os.environ.items() if key != "WORLD_SIZE"}
    done = subprocess.run(
        [sys.executable, "-m", "pipetrain", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout_s,
    )
    if done.returncode != 0:
        raise RuntimeError(f"pipetrain {' '.join(args)} failed:\n{done.stderr[-4000:]}")
    return done.stdout


def time_to_target(report: dict[str, Any], target: float | None) -> tuple[float, int] | None:
    """Seconds of training (summed step times) and steps until the held-out loss first
    reaches ``target``; ``None`` if it never does (or no target is given)."""
    if target is None:
        return None
    for evaluation in report["eval"]:
        if evaluation["loss"] <= target:
            steps = int(evaluation["step"])
            return sum(report["step_times_s"][:steps]), steps
    return None


def run(args: argparse.Namespace, cap_text: str, workdir: Path) -> list[dict[str, Any]]:
    """Measure, plan and train both configurations at one bandwidth; one row each."""
    cap = parse_bandwidth(cap_text)
    measured = measured_bandwidth(cap)
    print(
        f"{cap_text}: one TCP stream between hosts moves {measured * 8 / 1e6:.1f} Mbit/s",
        file=sys.stderr,
        flush=True,
    )
    profile, plan = workdir / "profile.json", workdir / f"plan-{cap:.0f}.json"
    common = ["--model", args.model, "--batch-size", str(args.batch_size)]
    pipetrain("profile", *common, "-o", str(profile))
    topology = f"{args.hosts}x{measured:.0f}B/s"
    pipetrain(
        "plan", "--profile", str(profile), "--topology", topology,
        "--batch-size", str(args.batch_size), "-o", str(plan),
    )  # fmt: skip
    rows = []
    for name, extra in (("ddp", ["--ddp"]), ("planned", ["--plan", str(plan)])):
        print(f"{cap_text}: training {name} on {args.hosts} hosts ...", file=sys.stderr, flush=True)
        output = pipetrain(
            "cluster", "--hosts", str(args.hosts), "--bandwidth", cap_text, "--json", "--",
            "train", *common, "--steps", str(args.steps),
            "--eval-every", str(args.eval_every), *extra,
        )  # fmt: skip
        report = json.loads(output.strip().splitlines()[-1])
        reached = time_to_target(report, args.target_loss)
        rows.append(
            {
                "bandwidth": cap_text,
                "measured_bandwidth_bytes_per_s": measured,
                "configuration": name,
                "schedule": report["schedule"],
                "workers": report["stages"],
                "time_to_target_s": None if reached is None else reached[0],
                "steps_to_target": None if reached is None else reached[1],
                "final_eval_loss": report["eval"][-1]["loss"] if report["eval"] else None,
                "samples_per_s": report["samples_per_s"],
                "step_s": report["step_s"],
                "predicted_step_s": report.get("planned_step_s"),
                "bytes_sent": report["cluster"]["bytes_sent"],
            }
        )
    return rows


def _cell(value: float | None, unit: str = "", scale: float = 1.0) -> str:
    return "not reached" if value is None else f"{value * scale:.3g}{unit}"


def table(rows: list[dict[str, Any]], target: float | None) -> str:
    """The rows as a Markdown table."""
    lines = [
        f"| link | config | schedule | to loss {target} | steps | samples/s | "
        "MB sent per host | step measured | step predicted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        predicted = row["predicted_step_s"]
        lines.append(
            f"| {row['bandwidth']} | {row['configuration']} | {row['schedule']} | "
            f"{_cell(row['time_to_target_s'], ' s')} | {row['steps_to_target'] or '-'} | "
            f"{row['samples_per_s']:.0f} | "
            + ", ".join(f"{sent / 1e6:.1f}" for sent in row["bytes_sent"])
            + f" | {row['step_s'] * 1e3:.1f} ms | "
            + ("-" if predicted is None else f"{predicted * 1e3:.1f} ms")
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="uneven-mlp")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--bandwidth", nargs="+", default=["100Mbit/s"])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--target-loss", type=float, help="held-out loss to reach")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    try:
        require_root()
    except ValueError as error:
        sys.exit(f"bench_cluster: {error}")
    with tempfile.TemporaryDirectory() as workdir:
        rows = [row for cap in args.bandwidth for row in run(args, cap, Path(workdir))]
    print(json.dumps(rows) if args.json else table(rows, args.target_loss))


if __name__ == "__main__":
    main()
