"""Does the planner's split beat an equal-layer split, and does its prediction hold?

Each round is one launch of 2 CPU worker processes with one thread each, which profile the
built-in ``uneven-mlp`` (layers of very different cost) at the same time, as the workers
will run, pool their profiles, plan a straight 2-stage pipeline for it on rank 0, and then
train with the planner's balance, with an equal layer-count balance and with the planner's
balance again, as ``pipetrain train --plan auto`` profiles and trains in the same processes.
It prints measured step times, the speedup (the planner's step: the median over both of
its runs), and the plan's predicted step time (and its steady step, every action at its
median) against that step and against the planner's first run alone, the one that follows
the plan as training does.
How far the planner's two runs differ is printed too: no prediction can hold more tightly
than the same run repeated.

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
from pipetrain.app.arguments import positive_int
from pipetrain.app.data import BatchStream
from pipetrain.app.models import build_model, loss_function
from pipetrain.app.plan_job import profile_together

MODEL = "uneven-mlp"
WARMUP = 5


def train(
    balance: list[int], schedule: str, microbatches: int, batch_size: int, steps: int
) -> list[float]:
    """Worker: step times of training ``MODEL`` split by ``balance``."""
    stream = BatchStream(MODEL, batch_size, seed=0)
    pipe = pipetrain.Pipeline(
        build_model(MODEL),
        balance=balance,
        microbatches=microbatches,
        schedule=schedule,
        loss_fn=loss_function(MODEL),
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
    )
    times = []
    for _ in range(steps):
        x, y = next(stream)
        dist.barrier()
        start = time.perf_counter()
        pipe.train_step(x, y)
        times.append(time.perf_counter() - start)
    return times


def round_worker(batch_size: int, microbatches: int, steps: int) -> tuple | None:
    """Worker: profile together, plan on rank 0, then time the planner's split, the equal
    split and the planner's split again; rank 0 returns the plan, the seconds profiling and
    planning took, and the three runs' step times."""
    started = time.perf_counter()
    profile = profile_together(MODEL, batch_size, microbatches)
    chosen = [
        pipetrain.plan(
            profile,
            workers=2,
            replication=False,
            schedules=("1f1b",),
            microbatches=(microbatches,),
            batch_size=batch_size,
        )
        if profile is not None
        else None
    ]
    dist.broadcast_object_list(chosen, src=0)
    plan = chosen[0]
    planned_s = time.perf_counter() - started
    layers = sum(plan.balance)
    equal = [layers // 2, layers - layers // 2]
    runs = [
        train(balance, plan.schedule, microbatches, batch_size, steps)[WARMUP:]
        for balance in (plan.balance, equal, plan.balance)
    ]
    return (plan, planned_s, runs) if dist.get_rank() == 0 else None


def main() -> None:
    """Profile, plan, measure both splits, in several rounds; print each round and the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rounds", type=positive_int, default=5)
    args = parser.parse_args()
    rows = []
    print(
        f"{'round':>5} {'planner balance':>16} {'planner ms':>11} {'equal ms':>9} {'speedup':>8} "
        f"{'predicted ms':>13} {'pred/meas':>10} {'pred/first':>11} {'steady/meas':>12} "
        f"{'rerun diff':>11}",
        flush=True,
    )
    for index in range(1, args.rounds + 1):
        plan, planned_s, runs = pipetrain.launch(
            round_worker, 2, args.batch_size, args.microbatches, args.steps, threads_per_worker=1
        )[0]
        first, equal_s, again = (statistics.median(steps) for steps in runs)
        ours = statistics.median(runs[0] + runs[2])
        row = {
            "speedup": equal_s / ours,
            "meas": plan.predicted_step_s / ours,
            "first": plan.predicted_step_s / first,
            "steady": plan.steady_step_s / ours,
            "rerun": abs(again - first) / ours,
            "planned_s": planned_s,
        }
        rows.append(row)
        print(
            f"{index:>5} {plan.balance!s:>16} {ours * 1e3:11.2f} {equal_s * 1e3:9.2f} "
            f"{row['speedup']:8.2f} {plan.predicted_step_s * 1e3:13.2f} {row['meas']:10.3f} "
            f"{row['first']:11.3f} {row['steady']:12.3f} {row['rerun']:11.1%}",
            flush=True,
        )
    print(f"\nthe last round's plan:\n{plan.describe()}\n")

    def column(name: str) -> list[float]:
        return [row[name] for row in rows]

    def summary(name: str, spec: str = ".3f") -> str:
        values = column(name)
        low, high = min(values), max(values)
        return f"median {statistics.median(values):{spec}} (range {low:{spec}}-{high:{spec}})"

    print(f"planner split vs equal split: {summary('speedup')}")
    for name, what in (
        ("meas", "both runs of the planner's split"),
        ("first", "its first run, right after planning"),
    ):
        within = sum(abs(r - 1) <= 0.1 for r in column(name))
        print(f"predicted / {what}: {summary(name)}; within 10% in {within} of {len(rows)} rounds")
    print(f"steady (every action at its median) / measured: {summary('steady')}")
    print(
        f"the planner's split measured twice in a round: runs differ by {summary('rerun', '.1%')}"
    )
    print(f"profiling and planning took {statistics.median(column('planned_s')):.1f} s (median)")


if __name__ == "__main__":
    main()
