"""Capture time against layer count, and what capturing on every rank costs.

A Llama-shaped model (``transformers.LlamaForCausalLM``, width 64, 4 heads) is built on the
meta device with ``--layers`` decoder layers (default 8, 32 and 80) and captured as
:class:`~pipetrain.Pipeline` captures it (:func:`pipetrain.model.capture.capture`, every
input dimension dynamic), then cut into its segments (``GraphModel``). Each count is timed
in a new process with one torch thread, ``--rounds`` times (the fastest and the median
given), beside a reference loop (``sum(range(10**6))``) timed just before.

Then ``--ranks`` processes capture the ``--shared``-layer model at once, as the ranks of a
pipeline do (each rank captures the whole model); the table gives the slowest rank's time
over the single capture's, both in the same round, the single one first.

    python benchmarks/bench_capture.py [--layers 8,32,80] [--shared 32] [--ranks 2]
        [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import pipetrain


def llama(layers: int) -> Any:
    """A Llama of ``layers`` decoder layers, width 64, built on the meta device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=layers, hidden_size=64, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
        max_position_embeddings=128,
    )  # fmt: skip
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def timed_capture(layers: int) -> dict[str, float]:
    """Worker: capture and cut the ``layers``-layer model; seconds for each, and the
    reference loop's."""
    from pipetrain.model.capture import capture
    from pipetrain.model.graph import GraphModel

    torch.set_num_threads(1)
    model = llama(layers)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    sample = {"input_ids": ids, "labels": ids}
    start = time.perf_counter()
    sum(range(10**6))
    reference = time.perf_counter() - start
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    captured = capture(model, sample)
    captured_s = time.perf_counter() - start
    GraphModel(model, sample, captured=captured)
    return {
        "capture": captured_s,
        "cut": time.perf_counter() - start - captured_s,
        "reference": reference,
    }


def main() -> None:
    """Time every count, then the capture on several ranks, and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="8,32,80")
    parser.add_argument("--shared", type=int, default=32)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    counts = [int(n) for n in args.layers.split(",")]
    single: dict[int, list[dict[str, float]]] = {n: [] for n in counts}
    ratios = []
    for _ in range(args.rounds):
        for layers in counts:
            single[layers].append(pipetrain.launch(timed_capture, 1, layers, timeout_s=900)[0])
        alone = pipetrain.launch(timed_capture, 1, args.shared, timeout_s=900)[0]
        ranks = pipetrain.launch(timed_capture, args.ranks, args.shared, timeout_s=900)
        ratios.append(max(r["capture"] for r in ranks) / alone["capture"])
    print(f"load {load:.2f} before, {os.getloadavg()[0]:.2f} after; {args.rounds} rounds")
    print("| decoder layers | capture s, fastest (median) | cut into segments s | reference ms |")
    print("|---:|---:|---:|---:|")
    for layers in counts:
        runs = single[layers]
        print(
            f"| {layers} | {min(r['capture'] for r in runs):.2f} "
            f"({statistics.median(r['capture'] for r in runs):.2f}) | "
            f"{statistics.median(r['cut'] for r in runs):.2f} | "
            f"{statistics.median(r['reference'] for r in runs) * 1e3:.1f} |"
        )
    print(
        f"\n{args.shared} layers captured on {args.ranks} ranks at once over one capture, per "
        f"round: {', '.join(f'{r:.2f}' for r in ratios)} (median {statistics.median(ratios):.2f})"
    )


if __name__ == "__main__":
    main()
