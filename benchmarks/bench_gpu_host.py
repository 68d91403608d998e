"""Where a one-stage pipeline's step goes on one GPU, beside the unpipelined loop that
accumulates its gradients over the same micro-batches.

One process, one GPU, bf16 autocast, the built-in GPT (as ``bench_gpu.py``: 1024 wide,
8 blocks, sequences of 256 bytes, batch 32, Adam) split into 4 micro-batches, trained
both ways in turn. For each way it prints:

- the median step time, and the host time: how long the step's Python took to hand
  everything to the GPU (the call's return, before waiting for the device), the two ways
  timed in turn, ``--rounds`` times, in alternating order;
- the calls per step that made the host wait for the GPU (``torch.cuda``'s sync debug
  mode), by the line that made them;
- from ``torch.profiler``: the GPU's busy time per step, the kernels launched per step,
  and the host operators that took the most time;
- for the pipeline, ``cProfile``'s costliest functions of the library itself.

    python benchmarks/bench_gpu_host.py [--steps 20] [--rounds 4] [--microbatches 4] [--out DIR]

``--out`` writes the profiler tables and cProfile listing there too; ``--device cpu``
runs the same on the CPU (a smoke test: no GPU to wait for).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from bench_gpu import LR, accumulating_step
from torch.profiler import ProfilerActivity, profile

import pipetrain
from pipetrain.app.data import BatchStream
from pipetrain.app.models import build_model, loss_function

WARMUP = 5
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel")  # cuLaunchKernelEx too


def _accumulating(
    shape: dict[str, int], parts: int, device: torch.device
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The unpipelined model's bf16 step, accumulating over ``parts`` micro-batches."""
    torch.manual_seed(0)
    return accumulating_step(build_model("gpt", **shape).to(device), parts, device, True)


def _pipelined(
    shape: dict[str, int], parts: int, device: torch.device
) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    torch.manual_seed(0)
    pipe = pipetrain.Pipeline(
        build_model("gpt", **shape),
        balance=[shape["n_layers"] + 2],
        microbatches=parts,
        schedule="1f1b",
        loss_fn=loss_function("gpt"),
        optimizer=lambda params: torch.optim.Adam(params, lr=LR),
        precision="bf16",
        runtime=pipetrain.RuntimeConfig(device=device),
    )
    return pipe.train_step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _sync_sites(
    step: Callable[..., Any], batches: list, device: torch.device
) -> collections.Counter[str]:
    """Each line that made the host wait for the GPU during ``batches``, with its count."""
    sites: collections.Counter[str] = collections.Counter()
    if device.type != "cuda":
        return sites
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x, y in batches:
                step(x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for warning in caught:
        if "synchroniz" in str(warning.message):
            sites[f"{os.path.relpath(warning.filename)}:{warning.lineno}"] += 1
    return sites


def _profiled(
    step: Callable[..., Any], batches: list, device: torch.device
) -> tuple[float, int, str]:
    """GPU busy ms per step, kernels per step and the host operators' table."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for x, y in batches:
            step(x, y)
        _sync(device)
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    launches = sum(e.count for e in events if e.key.startswith(LAUNCHES))
    table = events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=50)
    return device_us / 1e3 / len(batches), launches // len(batches), table


def _timed(step: Callable[..., Any], batches: list, device: torch.device) -> list[tuple]:
    """Each step's (wall, host) seconds over ``batches``, the first ``WARMUP`` left out."""
    times = []
    for k, (x, y) in enumerate(batches):
        _sync(device)
        start = time.perf_counter()
        loss = step(x, y)
        returned = time.perf_counter()
        float(loss)
        _sync(device)
        if k >= WARMUP:
            times.append((time.perf_counter() - start, returned - start))
    return times


def _inspected(
    name: str, step: Callable[..., Any], batches: list, device: torch.device, out: str | None
) -> dict[str, Any]:
    """What the profilers see of three steps: run after every timing, since a profiler
    session leaves the CUDA launch path slower for the rest of the process."""
    sites = _sync_sites(step, batches, device)
    busy, launches, table = _profiled(step, batches, device)
    profiler = cProfile.Profile()
    profiler.enable()
    for x, y in batches:
        float(step(x, y))
    profiler.disable()
    listing = io.StringIO()
    pstats.Stats(profiler, stream=listing).sort_stats("tottime").print_stats(25)
    if out:
        with open(os.path.join(out, f"{name}.txt"), "w") as file:
            file.write(table + "\n" + listing.getvalue())
    steps = len(batches)
    return {
        "busy": busy,
        "launches": launches,
        "syncs": {site: count / steps for site, count in sites.most_common(8)},
        "table": table,
        "listing": listing.getvalue(),
    }


def worker(args: argparse.Namespace) -> dict[str, dict]:
    """The one rank: both ways built, timed in alternating rounds (ABBA), then inspected."""
    device = torch.device(args.device)
    shape = {"d_model": args.d_model, "heads": 16, "n_layers": args.layers, "context": 256}
    stream = BatchStream("gpt", args.batch_size, seq_len=shape["context"], seed=0)
    batches = [next(stream) for _ in range(args.steps + WARMUP)]
    ways = {
        "accumulation loop": _accumulating(shape, args.microbatches, device),
        "pipetrain 1 stage": _pipelined(shape, args.microbatches, device),
    }
    times: dict[str, list[list[tuple]]] = {name: [] for name in ways}
    for round_ in range(args.rounds):
        for name in list(ways)[:: 1 if round_ % 2 == 0 else -1]:
            times[name].append(_timed(ways[name], batches, device))
    results = {}
    for name, step in ways.items():
        results[name] = _inspected(name.split()[0], step, batches[:3], device, args.out)
        results[name]["rounds"] = [
            (statistics.median(w for w, _ in t), statistics.median(h for _, h in t))
            for t in times[name]
        ]
    return results


def main() -> None:
    """Measure both ways and print them side by side."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA GPU is visible; give --device cpu for a smoke test")
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}", flush=True)
    backend = "nccl" if args.device == "cuda" else "gloo"
    results = pipetrain.launch(worker, 1, args, backend=backend, timeout_s=600)[0]
    for name, result in results.items():
        print(f"\n== {name}\n{result['table']}")
    print("\n== pipetrain, cProfile\n" + results["pipetrain 1 stage"]["listing"][:6000])
    for name, result in results.items():
        print(f"\n{name}: host-waiting calls a step:")
        for site, count in result["syncs"].items():
            print(f"  {count:5.1f}  {site}")
    print(f"\n{'way':20} {'step ms':>8} {'host ms':>8} {'GPU busy ms':>12} {'kernels':>8}")
    for name, result in results.items():
        step = statistics.median(w for w, _ in result["rounds"]) * 1e3
        host = statistics.median(h for _, h in result["rounds"]) * 1e3
        print(f"{name:20} {step:8.2f} {host:8.2f} {result['busy']:12.2f} {result['launches']:8d}")
    loop, pipe = (results[n]["rounds"] for n in ("accumulation loop", "pipetrain 1 stage"))
    ratios = sorted(a[0] / b[0] for a, b in zip(loop, pipe))
    print(
        f"pipetrain's speed against the loop, each round: "
        f"{', '.join(f'{r:.2f}' for r in ratios)} (median {statistics.median(ratios):.2f})"
    )


if __name__ == "__main__":
    main()
