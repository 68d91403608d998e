"""Every schedule both pipetrain and torch.distributed.pipelining have, step time side by side
on the same model, split, placement, micro-batches and optimizer.

Schedules: ``gpipe`` and ``1f1b`` (one stage a rank); ``interleaved``, ``looped-bfs`` and
``interleaved-zb`` (stages ``r`` and ``r + 2`` on rank ``r``); ``zb-v`` and ``dualpipev``
(stages ``r`` and ``3 - r``; ``dualpipev`` with ``full_backward`` on, as torch sends a full
backward's gradient after its weight pass). The last three split each backward into input
gradients (B) and weight gradients (W). Models: an MLP of 8 blocks (``Linear(1024, 1024)``
then ``tanh``, mean squared error; micro-batches of 32 rows) and the built-in GPT with 8
blocks (token-mean cross-entropy; micro-batches of 4 sequences of 64 tokens),
``--microbatches`` micro-batches, Adam.

2 gloo worker processes with 1 torch thread each. Each schedule's two runners (pipetrain's
``Pipeline`` and torch's ``PipelineStage`` + schedule class) live in the same two processes
and take steps in turn, the first of the pair alternating from step to step, so both see
the same machine load; every schedule of a model runs in the same processes, each round in
new ones. gloo's event-loop threads are switched before each step to what each library's
users have: ``SCHED_BATCH`` for pipetrain's steps (which marks them so), the default policy
for torch's. Per round, each schedule's ratio is pipetrain's median step time over torch's
(below 1: pipetrain faster); the table gives every round's ratio and their median.

    python benchmarks/bench_torch_schedules.py [--rounds 5] [--steps 16] [--microbatches 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import pipetrain
from pipetrain.app.data import BatchStream
from pipetrain.app.models import build_model, loss_function
from pipetrain.distributed.io_threads import defer_gloo_io_threads, loop_threads
from pipetrain.model.layers import StageModule, stage_bounds, to_layers
from pipetrain.runtime.rank.split_backward import input_pass

WARMUP = 3
RANKS = 2
SCHEDULES = ("gpipe", "1f1b", "interleaved", "looped-bfs", "interleaved-zb", "zb-v", "dualpipev")
SPLIT_BACKWARD = ("interleaved-zb", "zb-v", "dualpipev")
WIDTH = 1024
ROWS = {"mlp": 32, "gpt": 4}  # a micro-batch's


def torch_schedule(name: str) -> tuple[type, list[int]]:
    """torch's schedule class for ``name`` and the stages it places on each rank (rank 0's
    first; rank ``r`` holds ``r`` plus the offsets given)."""
    from torch.distributed import pipelining as pp

    classes = {
        "gpipe": pp.ScheduleGPipe,
        "1f1b": pp.Schedule1F1B,
        "interleaved": pp.ScheduleInterleaved1F1B,
        "looped-bfs": pp.ScheduleLoopedBFS,
        "interleaved-zb": pp.ScheduleInterleavedZeroBubble,
        "zb-v": pp.ScheduleZBVZeroBubble,
        "dualpipev": pp.ScheduleDualPipeV,
    }
    return classes[name], [0] if name in ("gpipe", "1f1b") else [0, RANKS]


def stages_of(name: str, rank: int) -> list[int]:
    """The stages rank ``rank`` holds under schedule ``name`` (torch's placement)."""
    if name in ("gpipe", "1f1b"):
        return [rank]
    if name in ("zb-v", "dualpipev"):
        return [rank, 2 * RANKS - 1 - rank]
    return [rank, rank + RANKS]


def mlp() -> nn.Sequential:
    """8 blocks of ``Linear(WIDTH, WIDTH)`` then ``tanh``, the same weights everywhere."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(8)))


def build(model_name: str) -> nn.Module:
    """A fresh copy of the model, the same weights in every process."""
    return mlp() if model_name == "mlp" else build_model("gpt", n_layers=8)


def batch(model_name: str, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed batch of ``rows`` rows."""
    if model_name == "mlp":
        generator = torch.Generator().manual_seed(1)
        return torch.randn(rows, WIDTH, generator=generator), torch.randn(
            rows, WIDTH, generator=generator
        )
    return next(BatchStream("gpt", rows, seed=0))


def balance_for(layers: int, stages: int) -> list[int]:
    """``layers`` split into ``stages`` stages as evenly as whole layers allow."""
    return [layers // stages + (1 if s < layers % stages else 0) for s in range(stages)]


def run_pair(model_name: str, microbatches: int, steps: int) -> dict[str, Any]:
    """Worker: for every schedule, pipetrain and torch on the same split, steps in turn."""
    rank = dist.get_rank()
    times: dict[str, dict[str, list[float]]] = {}
    x, y = batch(model_name, microbatches * ROWS[model_name])
    loss_fn = nn.functional.mse_loss if model_name == "mlp" else loss_function("gpt")
    runners = {}
    for name in SCHEDULES:
        kind, _ = torch_schedule(name)
        stages = stages_of(name, rank)
        count = RANKS * len(stages)
        layers = to_layers(build(model_name))
        balance = balance_for(len(layers), count)
        config = pipetrain.PipelineConfig(
            schedule=name,
            microbatches=microbatches,
            balance=balance,
            # torch's DualPipeV sends a full backward's input gradient after its W
            schedule_options={"full_backward": True} if name == "dualpipev" else {},
        )
        pipe = pipetrain.Pipeline(
            build(model_name),
            loss_fn=loss_fn,
            optimizer=lambda params: torch.optim.Adam(params, lr=1e-4),
            config=config,
        )
        if sorted(pipe.stages) != sorted(stages):
            raise RuntimeError(
                f"{name}: pipetrain holds stages {sorted(pipe.stages)}, torch {stages}"
            )
        bounds = stage_bounds(balance)
        modules = [StageModule(layers[slice(*bounds[s])]) for s in stages]
        torch_stages = [torch_stage(module, s, count) for module, s in zip(modules, stages)]
        optimizer = torch.optim.Adam([p for m in modules for p in m.parameters()], lr=1e-4)
        runner = kind(
            torch_stages if len(stages) > 1 else torch_stages[0], microbatches, loss_fn=loss_fn
        )
        runners[name] = (pipe, runner, optimizer, 0 in stages, count - 1 in stages)
        times[name] = {"pipetrain": [], "torch": []}

    def torch_step(name: str) -> None:
        _, runner, optimizer, first, last = runners[name]
        optimizer.zero_grad()
        arguments = (x,) if first else ()
        keywords = {"target": y, "losses": []} if last else {}
        runner.step(*arguments, **keywords)
        optimizer.step()

    for index in range(steps):
        turn = index % len(SCHEDULES)
        for name in SCHEDULES[turn:] + SCHEDULES[:turn]:
            pair = [("pipetrain", lambda n=name: runners[n][0].train_step(x, y)),
                    ("torch", lambda n=name: torch_step(n))]  # fmt: skip
            for library, step in pair if index % 2 else pair[::-1]:
                loop_threads_as(library)
                dist.barrier()
                start = time.perf_counter()
                step()
                if index >= WARMUP:
                    times[name][library].append(time.perf_counter() - start)
    return times


def loop_threads_as(library: str) -> None:
    """gloo's event-loop threads as each library's users have them: ``SCHED_BATCH`` for
    pipetrain (which marks them so), the default policy for torch (the two libraries share
    these processes and their gloo groups, so one policy would hold for both)."""
    if library == "pipetrain":
        defer_gloo_io_threads()
        return
    for thread in loop_threads():
        with suppress(OSError):  # the thread ended since it was found
            os.sched_setscheduler(thread, os.SCHED_OTHER, os.sched_param(0))


def torch_stage(module: nn.Module, index: int, count: int) -> Any:
    """torch's pipeline stage for ``module`` as stage ``index`` of ``count``."""
    from torch.distributed.pipelining import PipelineStage

    return PipelineStage(module, index, count, torch.device("cpu"))


def pass_costs(model_name: str, repeats: int = 40) -> dict[str, float]:
    """One process, one thread: the median seconds of a middle stage's backward on one
    micro-batch (its forward untimed), whole and split in two passes three ways:
    pipetrain's (:func:`input_pass`), the weight pass differentiating the outputs again
    (pipetrain before), and torch's ``stage_backward_input`` / ``stage_backward_weight``.
    The four take turns, after 5 untimed rounds."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    torch.set_num_threads(1)
    layers = to_layers(build(model_name))
    bounds = stage_bounds(balance_for(len(layers), 2 * RANKS))
    first, stage = (StageModule(layers[slice(*bounds[s])]) for s in (0, 1))
    with torch.no_grad():
        hidden = first(batch(model_name, ROWS[model_name])[0])
    weights = list(stage.parameters())
    grad = torch.randn_like(hidden)

    def whole(leaf: torch.Tensor, out: torch.Tensor) -> None:
        torch.autograd.backward(out, grad)

    def ours(leaf: torch.Tensor, out: torch.Tensor) -> None:
        input_pass((out,), (grad,), [leaf], weights)[1].run()

    def again(leaf: torch.Tensor, out: torch.Tensor) -> None:
        torch.autograd.grad(out, [leaf], grad, retain_graph=True)
        torch.autograd.backward(out, grad, inputs=weights)

    def theirs(leaf: torch.Tensor, out: torch.Tensor) -> None:
        groups = stage_backward_input([out], [grad], [leaf], iter(weights))[1]
        stage_backward_weight(iter(weights), groups)

    variants: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
        "whole": whole, "ours": ours, "again": again, "torch": theirs
    }  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in variants}
    for index in range(repeats + 5):
        for name, backward in variants.items():
            leaf = hidden.detach().requires_grad_(True)
            out = stage(leaf)
            start = time.perf_counter()
            backward(leaf, out)
            if index >= 5:
                times[name].append(time.perf_counter() - start)
            stage.zero_grad(set_to_none=True)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    """Run every round and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--models", default="mlp,gpt")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print("a middle stage's backward on one micro-batch, 1 process x 1 thread, ms "
          "(B + W: split in two passes)")  # fmt: skip
    print(f"{'model':5} {'whole':>8} {'B + W':>8} {'/ whole':>8} {'outputs again':>14} "
          f"{'/ whole':>8} {'torch B + W':>12} {'/ whole':>8}")  # fmt: skip
    for model_name in args.models.split(","):
        c = pass_costs(model_name)
        print(f"{model_name:5} {c['whole'] * 1e3:8.2f} {c['ours'] * 1e3:8.2f} "
              f"{c['ours'] / c['whole']:8.2f} {c['again'] * 1e3:14.2f} "
              f"{c['again'] / c['whole']:8.2f} {c['torch'] * 1e3:12.2f} "
              f"{c['torch'] / c['whole']:8.2f}", flush=True)  # fmt: skip
    ratios: dict[tuple[str, str], list[float]] = {}
    medians: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for round_index in range(args.rounds):
        for model_name in args.models.split(","):
            result = pipetrain.launch(
                run_pair, RANKS, model_name, args.microbatches, args.steps, threads_per_worker=1
            )
            for name in SCHEDULES:
                ours = max(statistics.median(r[name]["pipetrain"]) for r in result)
                theirs = max(statistics.median(r[name]["torch"]) for r in result)
                ratios.setdefault((model_name, name), []).append(ours / theirs)
                medians.setdefault((model_name, name), []).append((ours, theirs))
            print(f"round {round_index + 1}/{args.rounds}: {model_name} done", flush=True)
    print(
        f"\n{RANKS} ranks x 1 thread, {args.microbatches} micro-batches, "
        f"{args.steps - WARMUP} timed steps a round, {args.rounds} rounds; "
        f"load {load:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    print(f"{'model':5} {'schedule':15} {'pipetrain ms':>13} {'torch ms':>9} {'median':>7}  "
          "pipetrain / torch per round")  # fmt: skip
    for (model_name, name), values in ratios.items():
        ours = statistics.median(o for o, _ in medians[(model_name, name)])
        theirs = statistics.median(t for _, t in medians[(model_name, name)])
        mark = " (split backward)" if name in SPLIT_BACKWARD else ""
        print(
            f"{model_name:5} {name:15} {ours * 1e3:13.1f} {theirs * 1e3:9.1f} "
            f"{statistics.median(values):7.3f}  "
            f"{', '.join(f'{v:.2f}' for v in values)}{mark}"
        )


if __name__ == "__main__":
    main()
