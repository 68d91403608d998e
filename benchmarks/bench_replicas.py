"""Does starting the replicas' gradient all-reduce during the backward hide it?

Trains the built-in GPT as pure data parallelism: one stage holding every layer on 2
replicas (``replicas=[2]``), 2 CPU worker processes with 1 thread, 1F1B with 2 micro-batches
(one per replica). Two Pipelines live in the same processes and take steps in turn, so both
see the same machine load:

- one bucket larger than the model: the all-reduce starts when the backward has produced
  every gradient, so none of it overlaps the backward (the baseline);
- small buckets: each starts as soon as the backward has produced its gradients.

For each it prints the median step time and the median time the all-reduce action keeps
the rank waiting after the backward (from recorded steps).

    python benchmarks/bench_replicas.py [--steps 40] [--bucket-kib 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import pipetrain
from pipetrain.app.data import BatchStream
from pipetrain.app.models import build_model, loss_function

MODEL = "gpt"
WARMUP = 5
ONE_BUCKET = float("inf")


def run_pair(bucket_bytes: float, batch_size: int, steps: int) -> dict[str, list[float]]:
    """Worker: step times and all-reduce waits for one bucket vs ``bucket_bytes`` buckets."""
    pipes = {
        label: pipetrain.Pipeline(
            build_model(MODEL),
            loss_fn=loss_function(MODEL),
            optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
            config=pipetrain.PipelineConfig(
                balance=[len(build_model(MODEL))], replicas=[2], microbatches=2
            ),
            runtime=pipetrain.RuntimeConfig(bucket_bytes=size, record=True),
        )
        for label, size in (("one bucket", ONE_BUCKET), ("buckets", bucket_bytes))
    }
    results: dict[str, list[float]] = {
        f"{label} {what}": [] for label in pipes for what in ("step", "wait")
    }
    stream = BatchStream(MODEL, batch_size, seed=0)
    for index in range(steps):
        x, y = next(stream)
        for label, pipe in pipes.items():
            dist.barrier()
            start = time.perf_counter()
            pipe.train_step(x, y)
            elapsed = time.perf_counter() - start
            if index >= WARMUP:
                results[f"{label} step"].append(elapsed)
                results[f"{label} wait"] += [
                    e.end - e.start for e in pipe.recorder.events if e.kind == "ALLREDUCE"
                ]
    return results


def main() -> None:
    """Run the rounds and print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--bucket-kib", type=float, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rounds = [
        pipetrain.launch(
            run_pair, 2, args.bucket_kib * 1024, args.batch_size, args.steps, threads_per_worker=1
        )[0]
        for _ in range(args.rounds)
    ]
    gradient_kib = sum(p.numel() * p.element_size() for p in build_model(MODEL).parameters()) / 1024
    print(
        f"{MODEL} ({gradient_kib:.0f} KiB of gradients), 2 replicas x 1 thread, "
        f"batch {args.batch_size}, medians of {args.rounds} rounds"
    )
    print(f"{'all-reduce':26} {'step ms':>8} {'wait ms':>8} {'step vs one bucket':>19}")
    medians = {
        key: statistics.median(statistics.median(r[key]) for r in rounds) for key in rounds[0]
    }
    for label, name in (
        ("one bucket", "one bucket, after backward"),
        ("buckets", f"{args.bucket_kib:g} KiB buckets"),
    ):
        step, wait = medians[label + " step"], medians[label + " wait"]
        print(
            f"{name:26} {step * 1e3:8.2f} {wait * 1e3:8.2f} "
            f"{medians['one bucket step'] / step:19.2f}"
        )
    print(
        "per round, step one bucket / buckets: "
        + ", ".join(
            f"{statistics.median(r['one bucket step']) / statistics.median(r['buckets step']):.2f}"
            for r in rounds
        )
    )


if __name__ == "__main__":
    main()
