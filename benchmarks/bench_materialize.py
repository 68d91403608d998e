"""What a rank's memory grows by when the model is built on the meta device, against
building the whole model on every rank.

A GPT of GPT-2 small's shape (12 blocks of width 768, context 1024, a 50257-token
vocabulary, the head untied from the embedding, as tying cannot cross stages) runs on 4
CPU worker processes (1 thread each; 1f1b, balance 2/5/5/2, Adam), three times: built
under ``torch.device("meta")``, each rank allocating only its stage and initializing it
with its modules' ``reset_parameters()``; the same, loading the stage from a
``.safetensors`` file of the whole model; and built normally, the whole model on every
rank. Each rank takes ``--steps`` steps on a small batch and reports its peak resident
memory (VmHWM) less its resident memory when the worker started (torch imported, the group
joined), beside its stage's parameter, gradient and Adam state bytes (16 bytes a parameter).

    python benchmarks/bench_materialize.py [--steps 2] [--batch 2] [--length 32]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

import pipetrain
from pipetrain.app.models.gpt import Block, gpt_loss

VOCAB, WIDTH, HEADS, BLOCKS, CONTEXT = 50257, 768, 12, 12, 1024
BALANCE, RANKS, MICROBATCHES = [2, 5, 5, 2], 4, 2
BYTES_PER_PARAMETER = 16  # fp32 weight, gradient and Adam's two moments
MODES = ("meta", "meta + file", "normal")


class Embedding(nn.Module):
    """Token and learned position embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Embedding(CONTEXT, WIDTH)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.token(tokens) + self.position(positions)


class Head(nn.Module):
    """Final LayerNorm and the projection to the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.ln(x))


def gpt() -> nn.Sequential:
    """Embedding, 12 blocks, head: 14 pipeline layers."""
    blocks = [Block(WIDTH, HEADS, 0.0) for _ in range(BLOCKS)]
    return nn.Sequential(Embedding(), *blocks, Head())


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def worker(mode: str, path: str, steps: int, batch: int, length: int) -> dict[str, Any]:
    """Build the pipeline as ``mode`` says and take ``steps`` steps; this rank's memory
    growth, stage size and build time."""
    start_kib = _status_kib("VmRSS")
    began = time.perf_counter()
    torch.manual_seed(0)
    if mode == "normal":
        model = gpt()
    else:
        with torch.device("meta"):
            model = gpt()
    pipe = pipetrain.Pipeline(
        model,
        balance=BALANCE,
        microbatches=MICROBATCHES,
        loss_fn=gpt_loss,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-4),
        source=pipetrain.ModelSource(weights=path if mode == "meta + file" else None),
    )
    built_s = time.perf_counter() - began
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (batch, length + 1), generator=generator)
        losses.append(pipe.train_step(tokens[:, :-1], tokens[:, 1:]))
    return {
        "parameters": sum(p.numel() for p in pipe.parameters()),
        "model_parameters": sum(p.numel() for p in model.parameters()),
        "growth_bytes": (_status_kib("VmHWM") - start_kib) * 1024,
        "built_s": built_s,
        "losses": losses,
    }


def main() -> None:
    """Run the three builds on 4 ranks and print a table per rank."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        path = str(Path(directory) / "gpt.safetensors")
        torch.manual_seed(0)
        save_file(gpt().state_dict(), path)  # the model is freed before the workers start
        runs = {
            mode: pipetrain.launch(
                worker,
                RANKS,
                mode,
                path,
                args.steps,
                args.batch,
                args.length,
                timeout_s=600,
                threads_per_worker=1,
            )
            for mode in MODES
        }
    total = runs["meta"][0]["model_parameters"]
    print(f"model: {total / 1e6:.1f}M parameters ({total * 4 / 2**20:.0f} MiB in fp32)")
    for mode in MODES:
        print(f"losses, {mode}: {[round(x, 4) for x in runs[mode][0]['losses']]}")
    print(
        "| rank | stage parameters | stage bytes | meta: growth | meta / stage bytes "
        "| meta + file: growth | built normally: growth | build s (meta, file, normal) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    mib = 2**20
    for rank in range(RANKS):
        meta, file, normal = (runs[mode][rank] for mode in MODES)
        stage_bytes = meta["parameters"] * BYTES_PER_PARAMETER
        print(
            f"| {rank} | {meta['parameters'] / 1e6:.1f}M | {stage_bytes / mib:.0f} MiB "
            f"| {meta['growth_bytes'] / mib:.0f} MiB | {meta['growth_bytes'] / stage_bytes:.2f} "
            f"| {file['growth_bytes'] / mib:.0f} MiB | {normal['growth_bytes'] / mib:.0f} MiB "
            f"| {meta['built_s']:.1f}, {file['built_s']:.1f}, {normal['built_s']:.1f} |"
        )


if __name__ == "__main__":
    main()
