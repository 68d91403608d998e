"""Memory per rank of sharded stages: each rank's parameters, gradients and optimizer state,
its peak during a step against the planner's memory model, and the deepest GPT that trains
within a per-worker memory cap as the data-parallel degree grows.

Part 1 (the default, ``--held``): trains the built-in GPT (given as layers, 2 pipeline
stages, 1F1B, Adam) for two steps on ``2 x dp`` gloo workers, with every stage on ``dp``
replicas: whole copies (``shard=False``, PipeDream's replication) and shards
(``shard=True``), for ``dp`` in 1, 2 and 4. Each rank
counts the bytes it holds of its stage's parameters, gradients and Adam state (a shard's
local part only) after the second step; the table gives each against the same stage's
figure with one rank per stage, whose ``1/dp`` sharding aims at.

Part 2 (``--peaks``): on pp 2 x dp 2, whole copies and shards, under ``--schedule`` (1F1B,
GPipe), every rank's peak during two steps (after a first, so that gradients and optimizer
state exist) measured as ``bench_memory.py`` measures it (every live tensor storage, here
also following FSDP2's storages freed and refilled in place and a ``DTensor``'s local
shard), beside the planner's memory model (``Candidate.memory``) on the profile of the same
model at the same micro-batch size.

Part 3 (``--depths``): for dp 1, 2 and 4 (sharded; whole copies beside them with
``--whole``) on 2 pipeline stages under GPipe, a fixed batch, the largest number of
transformer blocks whose measured peak stays within ``--cap-mib`` on every rank: the
memory model proposes a depth, which is measured, then moved a block at a time to the
measured boundary.

    python benchmarks/bench_shard_memory.py [--held] [--peaks] [--depths] [--layers 8]
        [--d-model 128] [--cap-mib 96] [--whole]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from bench_memory import MIB, deeper
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import pipetrain
from pipetrain.app.data import BatchStream
from pipetrain.app.models import build_model, loss_function
from pipetrain.app.models.gpt import build_gpt, gpt_loss
from pipetrain.planning.candidates import Candidate
from pipetrain.planning.layouts import Layout
from pipetrain.profiler import Profile

BATCH, MICROBATCHES = 16, 4


def optimizer_tensors(pipe: pipetrain.Pipeline) -> list[torch.Tensor]:
    """The tensors of this rank's optimizer state (Adam's moments and steps)."""
    optimizer = pipe.optimizer
    return [
        value
        for per_parameter in (optimizer.state.values() if optimizer is not None else [])
        for value in per_parameter.values()
        if isinstance(value, torch.Tensor)
    ]


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
    state = optimizer_tensors(pipe)
    return {
        "stage": min(pipe.stages),
        "parameters": _bytes(parameters),
        "gradients": _bytes([p.grad for p in parameters if p.grad is not None]),
        "optimizer": _bytes(state),
    }


def held_table(args: argparse.Namespace) -> None:
    """Part 1: measure every layout and print the table of what each rank holds."""
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


class StorageBytes(TorchDispatchMode):
    """Within it, the peak of the bytes of live tensor storages: every storage an op makes,
    and those of the tensors given at the start, until freed; a storage's bytes are read
    after every op, since FSDP2 frees its gathered weights by resizing their storage to
    nothing and gathers into it again; a ``DTensor`` counts its local shard."""

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__()
        self.live: dict[int, weakref.ref[Any]] = {}
        self.peak = 0
        for tensor in existing:
            self._track(tensor)

    def _track(self, tensor: torch.Tensor) -> None:
        if isinstance(tensor, DTensor):
            tensor = tensor._local_tensor
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in self.live:
            self.live[key] = weakref.ref(storage, partial(self._freed, key))

    def _freed(self, key: int, _: object) -> None:
        self.live.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self._track(value)
        storages = (ref() for ref in list(self.live.values()))
        current = sum(storage.nbytes() for storage in storages if storage is not None)
        self.peak = max(self.peak, current)
        return out


@dataclass(frozen=True)
class ShardCase:
    """GPT of ``layers`` blocks on 2 stages x ``dp`` replicas (shards with ``shard``)."""

    layers: int
    dp: int
    shard: bool
    schedule: str
    d_model: int
    batch_size: int
    microbatches: int

    @property
    def balance(self) -> list[int]:
        """Blocks split evenly over the 2 stages; the embedding joins the first, the head
        the last."""
        first = self.layers // 2
        return [first + 1, self.layers - first + 1]


def peak_of_rank(case: ShardCase) -> dict[str, Any]:
    """On one worker: train ``case`` for three steps, the last two tracked; the peak."""
    model = build_model("gpt", seed=0, n_layers=case.layers, d_model=case.d_model)
    pipe = pipetrain.Pipeline(
        model,
        loss_fn=loss_function("gpt"),
        optimizer=partial(torch.optim.Adam, lr=1e-3),
        config=pipetrain.PipelineConfig(
            schedule=case.schedule,
            microbatches=case.microbatches,
            balance=case.balance,
            data_parallel=case.dp,
            shard=case.shard and case.dp > 1,
        ),
    )
    batch, labels = next(BatchStream("gpt", case.batch_size, seed=0))
    pipe.train_step(batch, labels)
    parameters = list(pipe.parameters())
    gradients = [p.grad for p in parameters if p.grad is not None]
    state = optimizer_tensors(pipe)
    tracker = StorageBytes([*parameters, *gradients, *state])
    del parameters, gradients, state  # the tracker holds weak references: let the step free them
    with tracker:
        for _ in range(2):
            pipe.train_step(batch, labels)
    return {"rank": pipe.rank, "peak": tracker.peak}


def measure(case: ShardCase) -> list[int]:
    """Every rank's peak, by rank."""
    results = pipetrain.launch(peak_of_rank, 2 * case.dp, case, threads_per_worker=1, timeout_s=600)
    return [r["peak"] for r in sorted(results, key=lambda r: r["rank"])]


@functools.cache
def block_profile(d_model: int, microbatch_size: int) -> Profile:
    """The profile of a one-block GPT (embedding, block, head) at ``microbatch_size``."""
    model = build_model("gpt", seed=0, n_layers=1, d_model=d_model)
    inputs, targets = next(BatchStream("gpt", microbatch_size, seed=0))
    return pipetrain.profile(model, inputs, targets, loss_function("gpt"), repeats=1, warmup=0)


def predicted(case: ShardCase) -> list[float]:
    """The memory model's peak on every rank of ``case`` (stage ``s`` on ranks
    ``s·dp .. s·dp + dp - 1``)."""
    base = block_profile(case.d_model, case.batch_size // case.microbatches)
    starts = [0, *itertools.accumulate(case.balance)]
    layout = Layout(
        tuple((start, stop, case.dp) for start, stop in itertools.pairwise(starts)),
        shard=case.shard and case.dp > 1,
    )
    candidate = Candidate(
        layout, case.schedule, case.microbatches, "never", deeper(base, case.layers)
    )
    by_stage = candidate.memory()
    return [by_stage[rank // case.dp] for rank in range(2 * case.dp)]


def peaks(args: argparse.Namespace) -> None:
    """Part 2: every rank's measured peak on pp 2 x dp 2 beside the memory model's."""
    print(
        f"\nGPT, {args.layers} blocks, d_model {args.d_model}, 2 stages x dp 2, batch "
        f"{args.batch_size} in {args.microbatches} micro-batches, Adam; peak per rank (MiB)\n\n"
        "| schedule | replicas hold | rank | measured peak | predicted | predicted / measured |"
        "\n|---|---|---|---|---|---|"
    )
    for schedule in args.schedules:
        for shard in (False, True):
            case = ShardCase(
                args.layers, 2, shard, schedule, args.d_model, args.batch_size,
                args.microbatches,
            )  # fmt: skip
            model = predicted(case)
            for rank, peak in enumerate(measure(case)):
                print(
                    f"| {schedule} | {'shards' if shard else 'whole copies'} | {rank} | "
                    f"{peak / MIB:.2f} | {model[rank] / MIB:.2f} | {model[rank] / peak:.3f} |",
                    flush=True,
                )


def deepest(dp: int, shard: bool, args: argparse.Namespace) -> str:
    """Part 3: the measured largest depth within the cap, as a table row."""
    cap = args.cap_mib * MIB

    def case(layers: int) -> ShardCase:
        return ShardCase(
            layers, dp, shard, "gpipe", args.d_model, args.batch_size, args.microbatches
        )

    proposal = 2
    while max(predicted(case(proposal + 1))) <= cap and proposal < 4096:
        proposal += 1
    measured: dict[int, float] = {}

    def peak(layers: int) -> float:
        if layers not in measured:
            print(f"  dp {dp}, shard {shard}: {layers} blocks ...", file=sys.stderr)
            measured[layers] = max(measure(case(layers)))
        return measured[layers]

    depth = max(proposal, 2)
    while depth > 2 and peak(depth) > cap:
        depth -= 1
    label = f"| {dp} | {'shards' if shard and dp > 1 else 'whole copies'} | {proposal} |"
    if peak(depth) > cap:
        return f"{label} none fits (2 blocks: {peak(depth) / MIB:.1f} MiB) | - | - |"
    while peak(depth + 1) <= cap:
        depth += 1
    return f"{label} {depth} | {peak(depth) / MIB:.1f} MiB | {peak(depth + 1) / MIB:.1f} MiB |"


def main() -> None:
    """Run the parts asked for (part 1 alone by default)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--held", action="store_true", help="part 1: what each rank holds")
    parser.add_argument("--peaks", action="store_true", help="part 2: peaks against the model")
    parser.add_argument("--depths", action="store_true", help="part 3: deepest within the cap")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="parts 2 and 3")
    parser.add_argument("--microbatches", type=int, default=8, help="parts 2 and 3")
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe"], help="part 2")
    parser.add_argument("--cap-mib", type=float, default=96.0, help="part 3")
    parser.add_argument("--whole", action="store_true", help="part 3: whole copies too")
    args = parser.parse_args()
    if not (args.held or args.peaks or args.depths):
        args.held = True
    if args.held:
        held_table(args)
    if args.peaks:
        peaks(args)
    if args.depths:
        print(
            f"\nGPipe on 2 stages x dp, GPT d_model {args.d_model}, batch {args.batch_size} in "
            f"{args.microbatches} micro-batches, Adam, every worker within {args.cap_mib:g} "
            "MiB\n\n| dp | replicas hold | model's largest depth | measured largest depth "
            "(blocks) | its peak | one block more |\n|---|---|---|---|---|---|"
        )
        for dp in (1, 2, 4):
            for shard in (True, False) if args.whole and dp > 1 else (True,):
                print(deepest(dp, shard, args), flush=True)


if __name__ == "__main__":
    main()
