"""Does the planner's split beat an equal-layer split, and does its prediction hold?

Profiles the built-in ``uneven-mlp`` (layers of very different cost) in 2 processes at
once with one thread each (as the workers will run), plans a straight 2-stage pipeline for it, then trains with the planner's
balance and with an equal layer-count balance, each on 2 CPU worker processes with one
thread, and prints measured step times, their ratio, and the plan's predicted step time
beside the measured one.

    python benchmarks/bench_plan.py [--steps 30] [--batch-size 128] [--microbatches 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import pipetrain
from pipetrain.data import BatchStream
from pipetrain.models import build_model, loss_function
from pipetrain.plan_job import profile_builtin

MODEL = "uneven-mlp"
WARMUP = 5


def train(balance: list[int], schedule: str, microbatches: int, batch_size: int, steps: int) -> list[float]:
    """Worker: step times of training ``MODEL`` split by ``balance``."""
    stream = BatchStream(MODEL, batch_size, seed=0)
    pipe = pipetrain.Pipeline(build_model(MODEL), balance=balance, microbatches=microbatches, schedule=schedule,
                              loss_fn=loss_function(MODEL), optimizer=lambda params: torch.optim.Adam(params, lr=1e-3))
    times = []
    for _ in range(steps):
        x, y = next(stream)
        dist.barrier()
        start = time.perf_counter()
        pipe.train_step(x, y)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    """Profile, plan, measure both splits, print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    started = time.perf_counter()
    profile = profile_builtin(MODEL, args.batch_size, args.microbatches, workers=2)
    plan = pipetrain.plan(profile, workers=2, replication=False, schedules=("1f1b",),
                          microbatches=(args.microbatches,), batch_size=args.batch_size)
    print(f"profiled and planned in {time.perf_counter() - started:.2f} s")
    print(plan.describe())
    layers = len(profile.layers)
    equal = [layers // 2, layers - layers // 2]
    rows = []
    for name, balance in (("planner", plan.balance), ("equal layers", equal)):
        times = pipetrain.launch(train, 2, balance, plan.schedule, args.microbatches, args.batch_size, args.steps,
                                 threads_per_worker=1)[0]
        rows.append((name, balance, statistics.median(times[WARMUP:])))
    print(f"\n{'split':14} {'balance':10} {'step ms':>9}")
    for name, balance, seconds in rows:
        print(f"{name:14} {str(balance):10} {seconds * 1e3:9.2f}")
    planner_s, equal_s = rows[0][2], rows[1][2]
    print(f"\nplanner split is {equal_s / planner_s:.2f}x faster than the equal split")
    print(f"predicted {plan.predicted_step_s * 1e3:.2f} ms, measured {planner_s * 1e3:.2f} ms, "
          f"predicted/measured {plan.predicted_step_s / planner_s:.3f}")


if __name__ == "__main__":
    main()
