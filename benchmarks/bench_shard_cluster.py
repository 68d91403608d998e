"""The planner's prediction of a sharded plan against its measured step on an emulated
cluster.

Needs root (``pipetrain cluster`` makes network namespaces). For each ``--bandwidth``
(``infB/s``: links not capped), ``--rounds`` runs of

    pipetrain cluster --hosts H --bandwidth B --json -- train --model M --plan auto \\
        --shard --steps N [--memory SIZE]

each a fresh job: the workers profile the model, measure the links and their collectives,
and plan among the layouts whose replicas hold shards (``--shard``), then train the plan.
Prints, per run, the layout the planner chose (sharded or not), its predicted step
(``planned_step_s``) and the measured median step, and their ratio.

    sudo python benchmarks/bench_shard_cluster.py [--model vgg] [--hosts 2] [--memory SIZE]
        [--bandwidth infB/s 1Gbit/s] [--steps 60] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from bench_cluster import pipetrain

from pipetrain.app.cluster_net import require_root


def run(args: argparse.Namespace, bandwidth: str) -> dict[str, Any]:
    """One cluster job at ``bandwidth``; its train report."""
    output = pipetrain(
        *("cluster", "--hosts", str(args.hosts), "--bandwidth", bandwidth, "--json"),
        *("--timeout", str(args.timeout), "--"),
        *("train", "--model", args.model, "--plan", "auto", "--shard"),
        *("--steps", str(args.steps)),
        *(("--memory", args.memory) if args.memory else ()),
        timeout_s=args.timeout + 60,
    )
    report: dict[str, Any] = json.loads(output.strip().splitlines()[-1])
    return report


def _layout(report: dict[str, Any]) -> str:
    """``gpipe, pp 1 x dp 2 sharded, 2 micro-batches``."""
    replicas = report["replicas"] or [1] * report["stages"]
    kind = " sharded" if report["shard"] else " whole copies" if max(replicas) > 1 else ""
    return (
        f"{report['schedule']}, {report['stages']} stage(s), replicas {replicas}{kind}, "
        f"{report['microbatches']} micro-batches"
    )


def main() -> None:
    """Run every bandwidth's rounds; print a markdown table and the median ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vgg")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--memory", help="per worker, for --plan auto (default: no limit)")
    parser.add_argument("--bandwidth", nargs="+", default=["infB/s", "1Gbit/s"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=600, help="seconds a job may take")
    args = parser.parse_args()
    require_root()
    print("| bandwidth | round | plan | planned step ms | measured step ms | planned / measured |")
    print("|---|---:|---|---:|---:|---:|")
    ratios: dict[str, list[float]] = {}
    for bandwidth in args.bandwidth:
        for round_ in range(1, args.rounds + 1):
            report = run(args, bandwidth)
            planned, measured = report["planned_step_s"], report["step_s"]
            ratios.setdefault(bandwidth, []).append(planned / measured)
            print(
                f"| {bandwidth} | {round_} | {_layout(report)} | {planned * 1e3:.1f} "
                f"| {measured * 1e3:.1f} | {planned / measured:.3f} |",
                flush=True,
            )
    for bandwidth, values in ratios.items():
        print(f"\n{bandwidth}: planned / measured, median {statistics.median(values):.3f}")


if __name__ == "__main__":
    main()
