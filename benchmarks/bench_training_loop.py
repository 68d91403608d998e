"""What global clipping and mixed precision cost per step, pipelined and unpipelined.

Trains the built-in GPT on 2 CPU worker processes (1 thread each; 1f1b, 4 micro-batches,
Adam) in five variants: plain fp32, fp32 with ``max_grad_norm``, bf16, fp16 (loss scale)
and fp16 with clipping; and the same five as the unpipelined model in one process (1 thread)
on the same micro-batches, clipping with ``torch.nn.utils.clip_grad_norm_`` and scaling with
``torch.amp.GradScaler``. Each variant's median step time is reported as a ratio to its own
setting's fp32 run, so the pipeline's overhead for a feature can be told from the feature's
own cost on this machine. Variants alternate over ``--rounds`` rounds; figures are medians.

    python benchmarks/bench_training_loop.py [--steps 12] [--batch 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import pipetrain
from pipetrain.app.data import BatchStream
from pipetrain.app.models import build_model, loss_function

MODEL, MICROBATCHES, WARMUP, MAX_NORM = "gpt", 4, 2, 1.0
VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {"precision": "fp32", "max_grad_norm": None},
    "fp32 + clip": {"precision": "fp32", "max_grad_norm": MAX_NORM},
    "bf16": {"precision": "bf16", "max_grad_norm": None},
    "fp16": {"precision": "fp16", "max_grad_norm": None},
    "fp16 + clip": {"precision": "fp16", "max_grad_norm": MAX_NORM},
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def pipelined(variant: str, batch: int, steps: int) -> list[float]:
    """Worker: step times of ``steps`` updates of the variant (after warm-up)."""
    pipe = pipetrain.Pipeline(
        build_model(MODEL),
        microbatches=MICROBATCHES,
        loss_fn=loss_function(MODEL),
        optimizer=adam,
        **VARIANTS[variant],
    )
    stream = BatchStream(MODEL, batch, seed=0)
    times = []
    for index in range(steps + WARMUP):
        x, y = next(stream)
        dist.barrier()
        start = time.perf_counter()
        pipe.train_step(x, y)
        if index >= WARMUP:
            times.append(time.perf_counter() - start)
    return times


def unpipelined(variant: str, batch: int, steps: int) -> list[float]:
    """Step times of the same variant on the whole model in this process."""
    settings = VARIANTS[variant]
    precision, max_norm = settings["precision"], settings["max_grad_norm"]
    model = build_model(MODEL)
    loss_fn = loss_function(MODEL)
    optimizer = adam(model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    stream = BatchStream(MODEL, batch, seed=0)
    times = []
    for index in range(steps + WARMUP):
        x, y = next(stream)
        start = time.perf_counter()
        optimizer.zero_grad()
        for xs, ys in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
            with torch.autocast(
                "cpu", dtype=DTYPES.get(precision, torch.float32), enabled=precision != "fp32"
            ):
                loss = loss_fn(model(xs), ys)
            scaler.scale(loss.float() / MICROBATCHES).backward()
        if max_norm is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()
        if index >= WARMUP:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    """Measure every variant both ways and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    piped: dict[str, list[float]] = {v: [] for v in VARIANTS}
    alone: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            times = pipetrain.launch(
                pipelined, 2, variant, args.batch, args.steps, threads_per_worker=1
            )[0]
            piped[variant].append(statistics.median(times))
            alone[variant].append(statistics.median(unpipelined(variant, args.batch, args.steps)))
    print("| variant | pipelined ms | vs pipelined fp32 | unpipelined ms | vs unpipelined fp32 |")
    print("|---|---:|---:|---:|---:|")
    base_piped = statistics.median(piped["fp32"])
    base_alone = statistics.median(alone["fp32"])
    for variant in VARIANTS:
        p, a = statistics.median(piped[variant]), statistics.median(alone[variant])
        print(
            f"| {variant} | {p * 1e3:.2f} | {p / base_piped:.2f} | {a * 1e3:.2f} | "
            f"{a / base_alone:.2f} |"
        )


if __name__ == "__main__":
    main()
