"""Memory per rank of sharded stages: each rank's parameters, gradients and optimizer state.

Trains the built-in GPT (given as layers, 2 pipeline stages, 1F1B, Adam) for two steps on
``2 x dp`` gloo workers, with every stage on ``dp`` replicas: whole copies (``shard=False``,
PipeDream's replication) and shards (``shard=True``), for ``dp`` in 1, 2 and 4. Each rank
counts the bytes it holds of its stage's parameters, gradients and Adam state (a shard's
local part only) after the second step; the table gives each against the same stage's
figure with one rank per stage, whose ``1/dp`` sharding aims at.

    python benchmarks/bench_shard_memory.py [--layers 8] [--d-model 128]
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from torch.distributed.tensor import DTensor

import pipetrain
from pipetrain.app.data import BatchStream
from pipetrain.app.models.gpt import build_gpt, gpt_loss

BATCH, MICROBATCHES = 16, 4


def _bytes(tensors: list[torch.Tensor]) -> int:
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def held(layers: int, d_model: int, dp: int, shard: bool) -> dict[str, int]:
    """Worker: two steps, then the bytes of parameters, gradients and optimizer state here."""
    torch.manual_seed(0)
    pipe = pipetrain.Pipeline(
        build_gpt(d_model=d_model, n_layers=layers),
        loss_fn=gpt_loss,
        optimizer=partial(torch.optim.Adam, lr=1e-3),
        config=pipetrain.PipelineConfig(
            schedule="1f1b", microbatches=MICROBATCHES, data_parallel=dp, shard=shard
        ),
    )
    stream = BatchStream("gpt", BATCH, seed=0)
    for _ in range(2):
        pipe.train_step(*next(stream))
    parameters = list(pipe.parameters())
    optimizer = pipe.optimizer
    state = [
        value
        for per_parameter in (optimizer.state.values() if optimizer is not None else [])
        for value in per_parameter.values()
        if isinstance(value, torch.Tensor)
    ]
    return {
        "stage": min(pipe.stages),
        "parameters": _bytes(parameters),
        "gradients": _bytes([p.grad for p in parameters if p.grad is not None]),
        "optimizer": _bytes(state),
    }


def main() -> None:
    """Measure every layout and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=128)
    args = parser.parse_args()
    rows = []
    for dp in (1, 2, 4):
        for shard in (False, True) if dp > 1 else (False,):
            results = pipetrain.launch(
                held, 2 * dp, args.layers, args.d_model, dp, shard, timeout_s=600
            )
            rows.append((dp, shard, results))
    whole = {r["stage"]: r["parameters"] + r["gradients"] + r["optimizer"] for r in rows[0][2]}
    print(
        f"GPT, {args.layers} blocks, d_model {args.d_model}, 2 stages, 1F1B, Adam; "
        "per rank after 2 steps (MiB)"
    )
    print(
        f"{'layout':22} {'rank':>4} {'stage':>5} {'params':>8} {'grads':>8} {'Adam':>8} "
        f"{'total':>8} {'of 1 rank':>10} {'1/dp':>6}"
    )
    for dp, shard, results in rows:
        label = f"dp {dp}, " + ("sharded" if shard else "whole copies")
        for rank, r in enumerate(results):
            total = r["parameters"] + r["gradients"] + r["optimizer"]
            print(
                f"{label:22} {rank:4d} {r['stage']:5d} {r['parameters'] / 2**20:8.2f} "
                f"{r['gradients'] / 2**20:8.2f} {r['optimizer'] / 2**20:8.2f} "
                f"{total / 2**20:8.2f} {total / whole[r['stage']]:10.3f} {1 / dp:6.3f}"
            )


if __name__ == "__main__":
    main()
