"""What a training step costs when glibc hands its freed memory back each step.

Trains built-in models on their own data, whole (forward, loss, backward, Adam's step,
gradients freed), in fresh processes, one at a time, alternating two arms:

- ``default``: glibc's own allocator policy (the baseline);
- ``kept``: the process first calls :func:`pipetrain.runtime.keep_freed_memory`, as the
  ``pipetrain`` command and ``launch``'s workers do.

It prints, per model and arm, the median step time, the minor page faults and the kernel
(system) CPU time per step, and the ratio of the median step times. A process is fresh for
each arm because the allocator's settings cannot be undone.

    python benchmarks/bench_heap.py [--models vgg gpt] [--steps 40] [--rounds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import statistics
import time

import torch

from pipetrain.app.data import BatchStream
from pipetrain.app.models import build_model, loss_function
from pipetrain.runtime import keep_freed_memory

WARMUP = 5
ARMS = ("default", "kept")
BATCH = 64


def _train(model_name: str, arm: str, steps: int) -> tuple[float, float, float]:
    """Median step seconds, minor faults per step and kernel CPU seconds per step."""
    if arm == "kept":
        keep_freed_memory()
    torch.set_num_threads(1)
    model = build_model(model_name, seed=0)
    loss_fn = loss_function(model_name)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    inputs, targets = next(BatchStream(model_name, BATCH, seed=0))
    times = []
    for index in range(WARMUP + steps):
        if index == WARMUP:
            before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        loss_fn(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return (
        statistics.median(times[WARMUP:]),
        (after.ru_minflt - before.ru_minflt) / steps,
        (after.ru_stime - before.ru_stime) / steps,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["vgg", "gpt"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    for model_name in args.models:
        runs: dict[str, list[tuple[float, float, float]]] = {arm: [] for arm in ARMS}
        for round_index in range(args.rounds):
            for arm in ARMS if round_index % 2 == 0 else reversed(ARMS):
                with context.Pool(1) as pool:
                    runs[arm].append(pool.apply(_train, (model_name, arm, args.steps)))
        medians = {}
        for arm in ARMS:
            step_s, faults, kernel_s = (statistics.median(column) for column in zip(*runs[arm]))
            medians[arm] = step_s
            print(
                f"{model_name:5} {arm:8} step {step_s * 1e3:7.2f} ms  faults/step {faults:8.0f}"
                f"  kernel {kernel_s * 1e3:6.2f} ms/step"
            )
        ratio = medians["kept"] / medians["default"]
        print(f"{model_name:5} kept / default step time: {ratio:.3f}")


if __name__ == "__main__":
    main()
