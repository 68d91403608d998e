"""Does the planner's split beat an equal-layer split, and does its prediction hold?

Profiles the built-in ``uneven-mlp`` (layers of very different cost) in 2 processes at
once with one thread each, as the workers will run (their profiles pooled), plans a straight 2-stage pipeline for
it, then trains with the planner's balance, with an equal layer-count balance and with the
planner's balance again, each on 2 CPU worker processes with one thread, and prints
measured step times (the planner's: the median over both of its runs), their ratio, and
the plan's predicted step time (and its steady step, every action at its median) beside
the measured one. How far the planner's two runs differ is printed too: no prediction can
hold more tightly than the same run repeated.

Step times on a shared machine move by ±15% from run to run, so the whole procedure
(profile, plan, measure the splits) repeats for ``--rounds`` rounds and the medians and
ranges are printed.

    python benchmarks/bench_plan.py [--steps 60] [--batch-size 128] [--microbatches 4] [--rounds 5]
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
    """Profile, plan, measure both splits, in several rounds; print each round and the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rows = []
    print(f"{'round':>5} {'planner balance':>16} {'planner ms':>11} {'equal ms':>9} {'speedup':>8} {'predicted ms':>13} "
          f"{'pred/meas':>10} {'steady/meas':>12} {'rerun diff':>11}", flush=True)
    for index in range(1, args.rounds + 1):
        started = time.perf_counter()
        profile = profile_builtin(MODEL, args.batch_size, args.microbatches, workers=2)
        plan = pipetrain.plan(profile, workers=2, replication=False, schedules=("1f1b",),
                              microbatches=(args.microbatches,), batch_size=args.batch_size)
        planned_s = time.perf_counter() - started
        layers = len(profile.layers)
        equal = [layers // 2, layers - layers // 2]
        # the planner's split runs before and after the equal one: how far its two runs
        # differ shows how well any prediction could hold on this machine
        runs = [
            pipetrain.launch(train, 2, balance, plan.schedule, args.microbatches, args.batch_size,
                             args.steps, threads_per_worker=1)[0][WARMUP:]
            for balance in (plan.balance, equal, plan.balance)
        ]
        first, equal_s, again = (statistics.median(steps) for steps in runs)
        ours = statistics.median(runs[0] + runs[2])
        rerun = abs(again - first) / ours
        rows.append((plan.balance, ours, equal_s, plan.predicted_step_s, planned_s, plan.steady_step_s, rerun))
        print(f"{index:>5} {plan.balance!s:>16} {ours * 1e3:11.2f} {equal_s * 1e3:9.2f} {equal_s / ours:8.2f} "
              f"{plan.predicted_step_s * 1e3:13.2f} {plan.predicted_step_s / ours:10.3f} "
              f"{plan.steady_step_s / ours:12.3f} {rerun:11.1%}", flush=True)
    print(f"\nthe last round's plan:\n{plan.describe()}")
    speedups = [theirs / ours for _, ours, theirs, *_ in rows]
    ratios = [predicted / ours for _, ours, _, predicted, *_ in rows]
    steady_ratios = [steady / ours for _, ours, _, _, _, steady, _ in rows]
    reruns = [row[-1] for row in rows]
    print(f"\nplanner split vs equal split: median {statistics.median(speedups):.2f}x (range {min(speedups):.2f}-{max(speedups):.2f})")
    print(f"predicted/measured: median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}); "
          f"within 10% in {sum(abs(r - 1) <= 0.1 for r in ratios)} of {len(ratios)} rounds")
    print(f"steady (every action at its median) / measured: median {statistics.median(steady_ratios):.3f}")
    print(f"the planner's split measured twice in a round: runs differ by median {statistics.median(reruns):.1%} "
          f"(at most {max(reruns):.1%})")
    print(f"profiling and planning took {statistics.median(r[4] for r in rows):.1f} s (median)")


if __name__ == "__main__":
    main()
