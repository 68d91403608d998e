"""A middle stage's backward on one micro-batch, whole and split into B (input gradients)
then W (weight gradients), in one process and one thread: this code's split against
torch's ``stage_backward_input`` / ``stage_backward_weight`` and, with ``--before FILE``,
against an earlier ``split_backward.py`` (any version with ``input_pass``).

The stage is the second of four of the models of ``bench_torch_schedules.py`` (GPT: 3
blocks, micro-batches of ``--gpt-rows`` sequences of 64 tokens; MLP: 2 blocks of
``Linear(1024, 1024)`` and ``tanh``, 32 rows). Each repetition runs a fresh forward
(untimed) then one backward per variant, the variants taking turns (who goes first
rotating), after 5 untimed repetitions; gradients accumulate into ``.grad`` as in a step
after its first micro-batch. Times are the thread's CPU time (``time.thread_time``),
medians; B and W are timed apart as well. glibc keeps freed memory as pipetrain's workers
do, and the cyclic collector is off while timing (a worker collects 0-1 times a step).

    git show REV:pipetrain/runtime/rank/split_backward.py > /tmp/before.py
    python benchmarks/bench_split_backward.py [--before /tmp/before.py] [--repeats 100]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_torch_schedules import RANKS, ROWS, balance_for, batch, build

from pipetrain.distributed.heap import keep_freed_memory
from pipetrain.model.layers import StageModule, stage_bounds, to_layers
from pipetrain.runtime.rank import split_backward

Split = Callable[[torch.Tensor, torch.Tensor], tuple[float, float]]


def load_input_pass(path: str) -> Callable[..., Any]:
    """``input_pass`` of the module at ``path`` (a file of this repository's history)."""
    spec = importlib.util.spec_from_file_location("split_backward_before", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--before {path!r}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.input_pass


def timings(model_name: str, rows: int, repeats: int, before: str | None) -> dict[str, Any]:
    """Median CPU seconds of each variant's backward, and of its B and W apart."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    layers = to_layers(build(model_name))
    bounds = stage_bounds(balance_for(len(layers), 2 * RANKS))
    first, stage = (StageModule(layers[slice(*bounds[s])]) for s in (0, 1))
    with torch.no_grad():
        hidden = first(batch(model_name, rows)[0])
    weights = list(stage.parameters())
    grad = torch.randn_like(hidden)

    def ours(input_pass: Callable[..., Any]) -> Split:
        def run(leaf: torch.Tensor, out: torch.Tensor) -> tuple[float, float]:
            start = time.thread_time()
            weight_pass = input_pass((out,), (grad,), [leaf], weights)[1]
            middle = time.thread_time()
            weight_pass.run()
            return middle - start, time.thread_time() - middle

        return run

    def theirs(leaf: torch.Tensor, out: torch.Tensor) -> tuple[float, float]:
        start = time.thread_time()
        groups = stage_backward_input([out], [grad], [leaf], iter(weights))[1]
        middle = time.thread_time()
        stage_backward_weight(iter(weights), groups)
        return middle - start, time.thread_time() - middle

    def whole(leaf: torch.Tensor, out: torch.Tensor) -> tuple[float, float]:
        torch.autograd.backward(out, grad)
        return 0.0, 0.0

    variants: dict[str, Split] = {"whole": whole, "pipetrain": ours(split_backward.input_pass)}
    if before is not None:
        variants["before"] = ours(load_input_pass(before))
    variants["torch"] = theirs
    total: dict[str, list[float]] = {name: [] for name in variants}
    parts: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    names = list(variants)
    # a training worker collects 0-1 times a step; here the growing lists of times would
    # set collections off inside whichever pass is running
    gc.disable()
    for index in range(repeats + 5):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            leaf = hidden.detach().requires_grad_(True)
            out = stage(leaf)
            start = time.thread_time()
            part = variants[name](leaf, out)
            if index >= 5:
                total[name].append(time.thread_time() - start)
                parts[name].append(part)
    gc.enable()
    return {
        name: (
            statistics.median(total[name]),
            statistics.median(b for b, _ in parts[name]),
            statistics.median(w for _, w in parts[name]),
        )
        for name in variants
    }


def main() -> None:
    """Print each model's table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="an earlier split_backward.py to compare")
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--models", default="gpt,mlp")
    parser.add_argument("--gpt-rows", type=int, default=ROWS["gpt"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()
    print(f"1 process x 1 thread, {args.repeats} repeats, load {os.getloadavg()[0]:.2f}")
    print(f"{'model':5} {'variant':10} {'B + W ms':>9} {'/ whole':>8} {'B ms':>7} {'W ms':>7}")
    for model_name in args.models.split(","):
        rows = args.gpt_rows if model_name == "gpt" else ROWS[model_name]
        result = timings(model_name, rows, args.repeats, args.before)
        whole = result["whole"][0]
        for name, (seconds, b, w) in result.items():
            split = f"{b * 1e3:7.3f} {w * 1e3:7.3f}" if name != "whole" else ""
            print(f"{model_name:5} {name:10} {seconds * 1e3:9.3f} {seconds / whole:8.3f} {split}")


if __name__ == "__main__":
    main()
