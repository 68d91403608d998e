"""Throughput of the asynchronous schedules against 1F1B at the same micro-batch size.

Trains the built-in GPT on 2 CPU worker processes (1 thread each) with micro-batches of
``--microbatch-size`` samples: 1f1b (one update per 4 micro-batches, flushed), pipedream
(an update per micro-batch, weight stashing, ``--window`` mini-batches per call) and 2bw
(an update per 4 micro-batches, ``--window``/4 updates per call). Prints samples/s, the
ratio to 1f1b, and the simulator's prediction for each from that run's measured costs.
Runs alternate over ``--rounds`` rounds; figures are medians.

    python benchmarks/bench_async.py [--steps 12] [--window 16] [--microbatch-size 8] [--rounds 3]
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
from pipetrain.simulation import measured_costs, simulate
from pipetrain.timeline import Timeline

MODEL = "gpt"
WARMUP = 2


def train(schedule: str, per_call: int, microbatch_size: int, steps: int) -> dict:
    """Worker: ``steps`` calls of ``train_step``; rank 0 returns call times and recorded
    timelines."""
    options = {
        "1f1b": {"microbatches": 4},
        "pipedream": {"microbatches": per_call},
        "2bw": {"microbatches": 4, "schedule_options": {"rounds": per_call // 4}},
    }[schedule]
    pipe = pipetrain.Pipeline(
        build_model(MODEL),
        loss_fn=loss_function(MODEL),
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
        config=pipetrain.PipelineConfig(schedule=schedule, **options),
    )
    samples = pipe.window * microbatch_size
    stream = BatchStream(MODEL, samples, seed=0)
    times, timelines = [], []
    for index in range(steps):
        x, y = next(stream)
        pipe.recorder.enabled = index >= WARMUP and index % 2 == 1
        dist.barrier()
        start = time.perf_counter()
        pipe.train_step(x, y)
        elapsed = time.perf_counter() - start
        if pipe.recorder.enabled:
            timeline = pipe.timeline()
            if timeline is not None:
                timelines.append(timeline.to_dict())
        elif index >= WARMUP:
            times.append(elapsed)
    return {"samples": samples, "times": times, "timelines": timelines, "schedule": pipe.schedule}


def main() -> None:
    """Measure every schedule and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--microbatch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {}
    predicted: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for schedule in ("1f1b", "pipedream", "2bw"):
            result = pipetrain.launch(
                train,
                2,
                schedule,
                args.window,
                args.microbatch_size,
                args.steps,
                threads_per_worker=1,
            )[0]
            rates.setdefault(schedule, []).append(
                result["samples"] / statistics.median(result["times"])
            )
            costs = measured_costs([Timeline.from_dict(t) for t in result["timelines"]], 2)
            predicted.setdefault(schedule, []).append(
                result["samples"] / simulate(result["schedule"], costs).makespan
            )
    print(
        f"{MODEL}, micro-batches of {args.microbatch_size}, 2 stages, 2 processes x 1 thread, "
        f"median of {args.rounds} alternating rounds"
    )
    print(
        f"{'schedule':10} {'samples/s':>10} {'vs 1f1b':>8} {'predicted/s':>12} "
        f"{'predicted vs 1f1b':>18}"
    )
    base, base_predicted = statistics.median(rates["1f1b"]), statistics.median(predicted["1f1b"])
    for schedule in rates:
        rate, guess = statistics.median(rates[schedule]), statistics.median(predicted[schedule])
        print(
            f"{schedule:10} {rate:10.1f} {rate / base:8.2f} {guess:12.1f} "
            f"{guess / base_predicted:18.2f}"
        )


if __name__ == "__main__":
    main()
