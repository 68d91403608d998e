"""Time to accuracy: data parallelism against the planner's pipelines on an emulated
cluster of capped links.

Needs root (``pipetrain cluster`` makes network namespaces). For each ``--bandwidth``
(``infB/s``: links not capped) it trains ``--model`` on ``--hosts`` namespaced hosts, one
``pipetrain cluster -- train`` run per configuration, all with the same model, global batch,
optimizer and learning rate:

- ``ddp``: ``torch.nn.parallel.DistributedDataParallel``, one replica per host;
- ``planned``: ``--plan auto``: the workers profile the model, measure the links between
  them and plan for that topology, choosing any schedule;
- ``planned-1f1b``, ``planned-pipedream``, ``planned-2bw``: the same, the planner held to
  that schedule (``--plan auto --schedule S``).

Each run evaluates on the held-out set every ``--eval-every`` steps. The script prints, per
configuration: the time to reach ``--target-accuracy`` (digits models) or ``--target-loss``
(the summed step times up to the first evaluation that reaches it; evaluation and planning
left out), the steps and epochs that took (statistical efficiency), samples/s at the median
step, the bytes each host sent (interface counters), and the planner's predicted step beside
the measured median (DDP has no prediction).

    sudo python benchmarks/bench_cluster.py [--model vgg] [--hosts 4]
        [--bandwidth 100Mbit/s infB/s] [--steps 60] [--eval-every 5]
        [--target-accuracy 0.9 | --target-loss 2.0] [--configs ddp planned ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipetrain.app.cluster_net import require_root
from pipetrain.app.data import BatchStream

ROOT = Path(__file__).resolve().parent.parent
CONFIGURATIONS = {
    "ddp": ["--ddp"],
    "planned": ["--plan", "auto"],
    "planned-1f1b": ["--plan", "auto", "--schedule", "1f1b"],
    "planned-pipedream": ["--plan", "auto", "--schedule", "pipedream"],
    "planned-2bw": ["--plan", "auto", "--schedule", "2bw"],
}


def pipetrain(*args: str, timeout_s: float = 1800) -> str:
    """Run ``python -m pipetrain ARGS``; its stdout, or RuntimeError with its stderr's end.
    The plan job's line on what it measured (links, messages, shared cores) is passed on."""
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
    for line in done.stderr.splitlines():
        if "links measured" in line:  # what the plan was made for, beside its rows
            print(line, file=sys.stderr, flush=True)
    return done.stdout


def time_to_target(
    report: dict[str, Any], metric: str, target: float | None
) -> tuple[float, int] | None:
    """Seconds of training (summed step times) and steps until the held-out ``metric``
    (``"accuracy"``: at least ``target``; ``"loss"``: at most) first reaches ``target``;
    ``None`` if it never does (or no target is given)."""
    if target is None:
        return None
    for evaluation in report["eval"]:
        value = evaluation.get(metric)
        if value is not None and (value >= target if metric == "accuracy" else value <= target):
            steps = int(evaluation["step"])
            return sum(report["step_times_s"][:steps]), steps
    return None


def run(args: argparse.Namespace, cap_text: str) -> list[dict[str, Any]]:
    """Train every configuration at one bandwidth; one row each."""
    metric, target = (
        ("accuracy", args.target_accuracy)
        if args.target_accuracy is not None
        else ("loss", args.target_loss)
    )
    steps_per_epoch = BatchStream(args.model, args.batch_size).epoch_size
    common = ["--model", args.model, "--batch-size", str(args.batch_size)]
    rows = []
    for name in args.configs:
        print(f"{cap_text}: training {name} on {args.hosts} hosts ...", file=sys.stderr, flush=True)
        output = pipetrain(
            "cluster", "--hosts", str(args.hosts), "--bandwidth", cap_text, "--json", "--",
            "train", *common, "--steps", str(args.steps),
            "--eval-every", str(args.eval_every), *CONFIGURATIONS[name],
        )  # fmt: skip
        report = json.loads(output.strip().splitlines()[-1])
        reached = time_to_target(report, metric, target)
        rows.append(
            {
                "bandwidth": cap_text,
                "configuration": name,
                "schedule": "ddp" if name == "ddp" else report["schedule"],
                "balance": report.get("balance"),
                "replicas": report.get("replicas"),
                "microbatches": report.get("microbatches"),
                "planned_topology": report.get("planned_topology"),
                "metric": metric,
                "target": target,
                "time_to_target_s": None if reached is None else reached[0],
                "steps_to_target": None if reached is None else reached[1],
                "epochs_to_target": None if reached is None else reached[1] / steps_per_epoch,
                "final_eval": report["eval"][-1] if report["eval"] else None,
                "samples_per_s": report["samples_per_s"],
                "step_s": report["step_s"],
                "predicted_step_s": report.get("planned_step_s"),
                "bytes_sent": report["training_bytes_sent"],
                "bytes_sent_whole_run": report["cluster"]["bytes_sent"],
                "steps": len(report["step_times_s"]),
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _cell(value: float | None, unit: str = "", scale: float = 1.0) -> str:
    return "not reached" if value is None else f"{value * scale:.3g}{unit}"


def _layout(row: dict[str, Any]) -> str:
    if row["configuration"] == "ddp":
        return "-"
    replicas = row["replicas"] or [1] * len(row["balance"] or [])
    return f"{row['balance']} on {replicas}, {row['microbatches']} mb"


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| link | config | schedule | layers on replicas | to target | steps (epochs) | "
        "samples/s | MB sent per host | step measured | step predicted | predicted / measured |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        predicted = row["predicted_step_s"]
        sent = ", ".join(f"{value / 1e6:.1f}" for value in row["bytes_sent"])
        epochs = row["epochs_to_target"]
        lines.append(
            f"| {row['bandwidth']} | {row['configuration']} | {row['schedule']} | "
            f"{_layout(row)} | {_cell(row['time_to_target_s'], ' s')} | "
            + ("-" if epochs is None else f"{row['steps_to_target']} ({epochs:.2f})")
            + f" | {row['samples_per_s']:.0f} | {sent} | {row['step_s'] * 1e3:.1f} ms | "
            + ("-" if predicted is None else f"{predicted * 1e3:.1f} ms")
            + " | "
            + ("-" if predicted is None else f"{predicted / row['step_s']:.2f}")
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="vgg")
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--bandwidth", nargs="+", default=["100Mbit/s"])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument(
        "--configs", nargs="+", default=list(CONFIGURATIONS), choices=CONFIGURATIONS
    )
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--target-accuracy", type=float, help="held-out accuracy to reach")
    target.add_argument("--target-loss", type=float, help="held-out loss to reach")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    try:
        require_root()
    except ValueError as error:
        sys.exit(f"bench_cluster: {error}")
    rows = [row for cap in args.bandwidth for row in run(args, cap)]
    print(json.dumps(rows) if args.json else table(rows))


if __name__ == "__main__":
    main()
