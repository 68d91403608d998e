"""pipetrain on one GPU against the unpipelined model: step time, peak memory and losses.

Trains the built-in GPT (by default 1024 wide, 8 blocks of 16 heads, sequences of 256
bytes, batch 32, Adam) three ways, each in fp32 and under bf16 autocast:

- unpipelined: the whole model on the GPU in one process (the baseline), and the same
  accumulating its gradients over 4 micro-batches (the baseline of the runs with 4);
- pipetrain, 1 stage under NCCL: the runtime's own cost on a GPU, with 1 and 4
  micro-batches;
- pipetrain, 2 stages sharing the GPU under gloo, 1F1B over 4 micro-batches: every
  message staged through pinned host memory (gloo sends only from the host).

Each configuration runs in new processes, every round in turn, so all see the same machine;
a figure is the median over the steps after warm-up, then over rounds. The table gives each
step time's ratio to the baseline at the same precision, the peak GPU memory a rank
allocated, and the largest relative difference of a step's loss from the baseline's over the
whole run (training is exact: fp32 differs only by rounding); ``vs same micro-batches``
divides by the unpipelined run that splits the batch as the pipeline does.

    python benchmarks/bench_gpu.py [--steps 30] [--rounds 2] [--d-model 1024] [--layers 8]

``--device cpu`` runs the same script on the CPU, NCCL replaced by gloo (a smoke test).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import pipetrain
from pipetrain.app.data import BatchStream
from pipetrain.app.models import build_model, loss_function

WARMUP = 5
LR = 1e-4


def _model(shape: dict[str, int]) -> torch.nn.Module:
    return build_model("gpt", **shape)


def _batches(shape: dict[str, int], batch_size: int, steps: int) -> list:
    stream = BatchStream("gpt", batch_size, seq_len=shape["context"], seed=0)
    return [next(stream) for _ in range(steps)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_bytes(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def accumulating_step(
    model: torch.nn.Module, parts: int, device: torch.device, autocast: bool
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The unpipelined model's training step with Adam, its gradients accumulated over
    ``parts`` equal parts of each batch (1: none); the step returns the batch's loss
    without waiting for it."""
    loss_fn = loss_function("gpt")
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x, y = x.to(device), y.to(device)
        total = torch.zeros((), device=device)
        for x_part, y_part in zip(x.chunk(parts), y.chunk(parts)):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                logits = model(x_part)
            loss = loss_fn(logits.float(), y_part) / parts  # equal parts: the batch's mean
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        return total

    return step


def unpipelined(shape: dict[str, int], run: dict[str, Any]) -> dict[str, Any]:
    """Worker: the whole model on the device in this process, its gradients accumulated
    over ``run["microbatches"]`` equal parts of each batch (1: none)."""
    device = torch.device(run["device"])
    model = _model(shape).to(device)
    step = accumulating_step(model, run.get("microbatches", 1), device, run["precision"] == "bf16")
    times, losses = [], []
    for x, y in _batches(shape, run["batch"], run["steps"]):
        _sync(device)
        start = time.perf_counter()
        losses.append(step(x, y).item())
        times.append(time.perf_counter() - start)
    return {"times": times, "losses": losses, "peak": _peak_bytes(device)}


def pipelined(shape: dict[str, int], run: dict[str, Any]) -> dict[str, Any]:
    """Worker: one rank of a pipetrain pipeline over the same model."""
    pipe = pipetrain.Pipeline(
        _model(shape),
        balance=run["balance"],
        microbatches=run["microbatches"],
        schedule="1f1b",
        loss_fn=loss_function("gpt"),
        optimizer=lambda params: torch.optim.Adam(params, lr=LR),
        precision=run["precision"],
        runtime=pipetrain.RuntimeConfig(device=run["device"] if run["backend"] == "gloo" else None),
    )
    device = pipe.device
    times, losses = [], []
    for x, y in _batches(shape, run["batch"], run["steps"]):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        losses.append(pipe.train_step(x, y))
        _sync(device)
        times.append(time.perf_counter() - start)
    return {"times": times, "losses": losses, "peak": _peak_bytes(device)}


def _runs(device: str, blocks: int) -> list[tuple[str, dict[str, Any]]]:
    """Each configuration's label and launch settings, for a model of ``blocks`` layers."""
    nccl = "nccl" if device == "cuda" else "gloo"
    whole, halves = [blocks], [blocks // 2, blocks - blocks // 2]
    return [
        ("unpipelined", {"ranks": 1, "backend": "gloo"}),
        ("unpipelined, 4 mb accumulated", {"ranks": 1, "backend": "gloo", "microbatches": 4}),
        (
            f"pipetrain 1 stage, {nccl}, 1 mb",
            {"ranks": 1, "backend": nccl, "microbatches": 1, "balance": whole},
        ),
        (
            f"pipetrain 1 stage, {nccl}, 4 mb",
            {"ranks": 1, "backend": nccl, "microbatches": 4, "balance": whole},
        ),
        (
            "pipetrain 2 stages, gloo, 4 mb",
            {"ranks": 2, "backend": "gloo", "microbatches": 4, "balance": halves},
        ),
    ]


def _launch(shape: dict[str, int], run: dict[str, Any]) -> dict[str, Any]:
    worker = unpipelined if run["name"].startswith("unpipelined") else pipelined
    results = pipetrain.launch(
        worker, run["ranks"], shape, run, backend=run["backend"], timeout_s=300
    )
    return {
        "step": statistics.median(results[0]["times"][WARMUP:]),
        "losses": results[0]["losses"],
        "peak": max(result["peak"] for result in results),
    }


def main() -> None:
    """Run every configuration for every round and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA GPU is visible; give --device cpu for a smoke test")
    shape = {
        "d_model": args.d_model,
        "heads": args.heads,
        "n_layers": args.layers,
        "context": args.seq_len,
    }
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(
        f"GPT {args.d_model} wide, {args.layers} blocks, sequences of {args.seq_len}, batch "
        f"{args.batch_size}, Adam; {name}, torch {torch.__version__}; median of {args.rounds} "
        f"rounds of {args.steps} steps ({WARMUP} warm-up)",
        flush=True,
    )
    blocks = args.layers + 2
    table: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(args.rounds):
        for precision in ("fp32", "bf16"):
            for label, run in _runs(args.device, blocks):
                run = {
                    **run,
                    "name": label,
                    "device": args.device,
                    "precision": precision,
                    "batch": args.batch_size,
                    "steps": args.steps,
                }
                table.setdefault((precision, label), []).append(_launch(shape, run))
    print(
        f"{'precision':9} {'run':34} {'step ms':>9} {'vs unpipelined':>15} "
        f"{'vs same micro-batches':>22} {'peak MiB':>9} {'max loss diff':>14}"
    )
    for precision in ("fp32", "bf16"):
        base = table[(precision, "unpipelined")]
        base_step = statistics.median(r["step"] for r in base)
        baselines = {
            run.get("microbatches", 1): statistics.median(r["step"] for r in table[(precision, n)])
            for n, run in _runs(args.device, blocks)
            if n.startswith("unpipelined")
        }
        for label, run in _runs(args.device, blocks):
            results = table[(precision, label)]
            step = statistics.median(r["step"] for r in results)
            peak = max(r["peak"] for r in results) / 2**20
            diff = max(abs(a - b) / abs(b) for a, b in zip(results[0]["losses"], base[0]["losses"]))
            print(
                f"{precision:9} {label:34} {step * 1e3:9.2f} {base_step / step:15.2f} "
                f"{baselines[run.get('microbatches', 1)] / step:22.2f} {peak:9.0f} {diff:14.2e}"
            )
    print("'vs unpipelined' is a speedup (below 1: slower than the unpipelined model).")


if __name__ == "__main__":
    main()
