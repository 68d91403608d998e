"""The runtime's host cost per action: pipetrain against torch.distributed.pipelining and a
hand-written loop of ``dist.isend`` / ``dist.recv`` (the floor), on layers so small that
the step is nearly all bookkeeping.

Two gloo ranks, one thread each, hold two stages of ``--layers`` blocks of
``Linear(16, 16)`` and ``tanh`` (rows of ``--rows`` samples, ``--microbatches``
micro-batches a step, mean-squared-error loss, SGD). Each step is run by four runners in
turn, who goes first rotating step by step: pipetrain, torch's ``ScheduleGPipe`` /
``Schedule1F1B``, the hand-written loop of the same order, and ``compute``: the rank's own
stage, forward and backward on every micro-batch with nothing sent (the model's own
work). A runner's host cost per action is its step time less ``compute``'s, over the
``2 × micro-batches`` forwards and backwards of a rank's step; each figure is the median
over ``--rounds`` rounds (new processes each) of the slower rank's median step. Each
runner's steps run with gloo's event-loop threads as its users have them: marked
``SCHED_BATCH`` for pipetrain's, which marks them so, at the default policy for torch's and
the floor's (with ``--same-threads``, marked for every runner).

    python benchmarks/bench_host_cost.py [--rounds 5] [--steps 30] [--same-threads]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from bench_torch_schedules import loop_threads_as
from torch import nn

import pipetrain
from pipetrain.model.layers import StageModule, stage_bounds, to_layers

RANKS, WIDTH, WARMUP = 2, 16, 5
SCHEDULES = ("gpipe", "1f1b")
RUNNERS = ("pipetrain", "torch", "floor", "compute")


def model(layers: int) -> nn.Sequential:
    """``layers`` blocks of ``Linear(WIDTH, WIDTH)`` and ``tanh``, the same in every process."""
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(layers))
    )


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean squared error, as every runner computes it."""
    return nn.functional.mse_loss(output, target)


class Floor:
    """The least a pipeline rank can do: its stage's forwards and backwards in the
    schedule's order, activations and gradients sent with ``isend`` and received with
    ``recv``, the loss over micro-batches summed, then an SGD step."""

    def __init__(self, stage: nn.Module, schedule: str, microbatches: int, rows: int) -> None:
        self.stage, self.schedule, self.microbatches = stage, schedule, microbatches
        self.rank = dist.get_rank()
        self.shape = (rows, WIDTH)
        self.optimizer = torch.optim.SGD(stage.parameters(), lr=1e-3)

    def order(self) -> list[tuple[str, int]]:
        """The rank's forwards (``F``) and backwards (``B``) in the schedule's order."""
        m = self.microbatches
        if self.schedule == "gpipe":
            return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
        ahead = RANKS - self.rank - 1  # forwards before the first backward
        order = [("F", i) for i in range(min(ahead, m))]
        for i in range(m):
            if i + ahead < m:
                order.append(("F", i + ahead))
            order.append(("B", i))
        return order

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One training step on the micro-batches of ``x`` and ``y``."""
        first, last = self.rank == 0, self.rank == RANKS - 1
        inputs = x.chunk(self.microbatches) if first else None
        targets = y.chunk(self.microbatches) if last else None
        kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        pending = []
        for kind, i in self.order():
            if kind == "F":
                if first:
                    assert inputs is not None
                    leaf = inputs[i]
                else:
                    leaf = torch.empty(self.shape)
                    dist.recv(leaf, self.rank - 1)
                    leaf.requires_grad_(True)
                out = self.stage(leaf)
                if last:
                    assert targets is not None
                    out = loss_fn(out, targets[i]) / self.microbatches
                else:
                    pending.append(dist.isend(out.detach(), self.rank + 1))
                kept[i] = (leaf, out)
            else:
                leaf, out = kept.pop(i)
                if last:
                    out.backward()
                else:
                    grad = torch.empty(self.shape)
                    dist.recv(grad, self.rank + 1)
                    out.backward(grad)
                if not first:
                    assert leaf.grad is not None
                    pending.append(dist.isend(leaf.grad, self.rank - 1))
        for work in pending:
            work.wait()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def compute_only(stage: nn.Module, microbatches: int, x: torch.Tensor) -> Callable[[], None]:
    """The rank's stage alone: a forward and a backward of every micro-batch, nothing sent."""
    parts = x.chunk(microbatches)

    def run() -> None:
        for part in parts:
            stage(part.detach().requires_grad_(True)).sum().backward()
        stage.zero_grad(set_to_none=True)

    return run


def run_all(
    layers: int, microbatches: int, rows: int, steps: int, same_threads: bool
) -> dict[str, Any]:
    """Worker: every schedule and runner, steps in turn; rank's step times by runner. gloo's
    loop threads are as pipetrain marks them for its steps, and for the others' only with
    ``same_threads`` (else at the default policy, as torch's users have them)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(microbatches * rows, WIDTH, generator=generator)
    y = torch.randn(microbatches * rows, WIDTH, generator=generator)
    balance = [layers // RANKS] * RANKS
    bounds = stage_bounds(balance)[rank]
    runners: dict[str, dict[str, Callable[[], None]]] = {}
    for name in SCHEDULES:
        pipe = pipetrain.Pipeline(
            model(layers),
            loss_fn=loss_fn,
            optimizer=lambda params: torch.optim.SGD(params, lr=1e-3),
            config=pipetrain.PipelineConfig(
                schedule=name, microbatches=microbatches, balance=balance
            ),
        )
        theirs = StageModule(to_layers(model(layers))[slice(*bounds)])
        torch_optimizer = torch.optim.SGD(theirs.parameters(), lr=1e-3)
        kind = ScheduleGPipe if name == "gpipe" else Schedule1F1B
        schedule = kind(
            PipelineStage(theirs, rank, RANKS, torch.device("cpu")), microbatches, loss_fn=loss_fn
        )
        floor = Floor(
            StageModule(to_layers(model(layers))[slice(*bounds)]), name, microbatches, rows
        )
        alone = StageModule(to_layers(model(layers))[slice(*bounds)])

        def torch_step(schedule: Any = schedule, optimizer: Any = torch_optimizer) -> None:
            keywords = {"target": y, "losses": []} if rank == RANKS - 1 else {}
            schedule.step(*((x,) if rank == 0 else ()), **keywords)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        runners[name] = {
            "pipetrain": lambda pipe=pipe: pipe.train_step(x, y),
            "torch": torch_step,
            "floor": lambda floor=floor: floor.step(x, y),
            "compute": compute_only(alone, microbatches, x),
        }
    times = {name: {runner: [] for runner in RUNNERS} for name in SCHEDULES}
    for index in range(steps):
        for name in SCHEDULES:
            turn = index % len(RUNNERS)
            for runner in RUNNERS[turn:] + RUNNERS[:turn]:
                loop_threads_as("pipetrain" if runner == "pipetrain" or same_threads else "torch")
                dist.barrier()
                start = time.perf_counter()
                runners[name][runner]()
                if index >= WARMUP:
                    times[name][runner].append(time.perf_counter() - start)
    return times


def main() -> None:
    """Run every round and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--microbatches", type=int, default=64)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--same-threads",
        action="store_true",
        help="run torch's and the floor's steps with gloo's loop threads marked as pipetrain "
        "marks them too (by default they run at the default policy, as torch's users have them)",
    )
    args = parser.parse_args()
    load = os.getloadavg()[0]
    steps: dict[tuple[str, str], list[float]] = {}
    for round_index in range(args.rounds):
        result = pipetrain.launch(
            run_all, RANKS, args.layers, args.microbatches, args.rows, args.steps,
            args.same_threads, threads_per_worker=1,
        )  # fmt: skip
        for name in SCHEDULES:
            for runner in RUNNERS:
                slowest = max(statistics.median(r[name][runner]) for r in result)
                steps.setdefault((name, runner), []).append(slowest)
        print(f"round {round_index + 1}/{args.rounds} done", flush=True)
    actions = 2 * args.microbatches
    print(
        f"\n{RANKS} ranks x 1 thread, {args.layers} blocks of Linear({WIDTH}) + tanh, "
        f"{args.microbatches} micro-batches of {args.rows} rows, {args.steps - WARMUP} timed "
        f"steps a round, {args.rounds} rounds, torch's loop threads "
        f"{'as pipetrain marks them' if args.same_threads else 'at the default policy'}; "
        f"load {load:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after"
    )
    print("| schedule | runner | step ms | host µs an action | × floor | × torch |")
    print("|---|---|---:|---:|---:|---:|")
    for name in SCHEDULES:
        compute = statistics.median(steps[(name, "compute")])
        host = {
            runner: (statistics.median(steps[(name, runner)]) - compute) / actions
            for runner in RUNNERS[:3]
        }
        for runner in RUNNERS:
            step = statistics.median(steps[(name, runner)])
            if runner == "compute":
                print(f"| {name} | compute (the stage alone) | {step * 1e3:.1f} | | | |")
                continue
            print(
                f"| {name} | {runner} | {step * 1e3:.1f} | {host[runner] * 1e6:.0f} | "
                f"{host[runner] / host['floor']:.2f} | {host[runner] / host['torch']:.2f} |"
            )


if __name__ == "__main__":
    main()
