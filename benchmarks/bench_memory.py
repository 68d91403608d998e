"""Memory scaling: every rank's measured peak against the planner's memory model, and the
deepest GPT that trains within a per-worker memory cap on 1, 2 and 4 stages, with and
without re-materialization (GPipe's Table 1 at small scale).

Measured: each rank trains a few steps of the built-in GPT (``d_model`` 64, 64-byte
windows) under :class:`LiveBytes`, a ``TorchDispatchMode`` that follows every tensor
storage an operator makes on the rank (activations, the backward's temporaries, stashed
weights, message buffers) and those of the weights, gradients and optimizer state that
exist before, until each is freed, and records the peak of their sum
(``torch.distributed._tools.MemTracker`` refuses a module called once per micro-batch).
The first step runs before tracking starts, so that gradients and optimizer state exist,
as in any later step.
Predicted: the planner's memory model (``Candidate.memory``) on the profile of the same
model at the same micro-batch size (saved activations measured by the profiler).

Part 1 (``--check``): one row per schedule and recompute mode on ``--stages`` workers, the
measured peak of the rank where it is highest beside its prediction, and the largest
prediction error over all ranks.

Part 2 (``--depths``): for each stage count and recompute mode under GPipe, the largest
number of transformer blocks whose measured peak stays within ``--cap-mib`` on every
rank: the memory model proposes a depth, which is measured, then the depth is moved one
block at a time until the measured boundary is found (a depth that fits, one more that
does not).

    python benchmarks/bench_memory.py [--check] [--depths] [--cap-mib 48] [--batch-size 32]
        [--microbatches 8] [--stages 4] [--layers 8]
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
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import pipetrain
from pipetrain.app.data import BatchStream
from pipetrain.app.models import build_model, loss_function
from pipetrain.planning.candidates import Candidate
from pipetrain.planning.layouts import Layout
from pipetrain.profiler import LayerCost, Profile
from pipetrain.runtime import PipelineConfig, launch
from pipetrain.schedules import spec

MODEL = "gpt"
MIB = 2**20
CHECKED = [
    ("gpipe", {}),
    ("1f1b", {}),
    ("interleaved", {"virtual": 2}),
    ("zb-h1", {}),
    ("2bw", {}),
    ("pipedream", {}),
]


@dataclass(frozen=True)
class Case:
    """One measured configuration."""

    layers: int
    stages: int
    schedule: str
    recompute: str
    microbatches: int
    batch_size: int
    virtual: int = 1

    @property
    def chunks(self) -> int:
        """Model stages (chunks) the layers are split into."""
        return self.stages * self.virtual

    @property
    def balance(self) -> list[int]:
        """Blocks as evenly as they go over the chunks; the embedding joins the first,
        the head the last."""
        base, extra = divmod(self.layers, self.chunks)
        blocks = [base + (chunk < extra) for chunk in range(self.chunks)]
        blocks[0] += 1
        blocks[-1] += 1
        return blocks


class LiveBytes(TorchDispatchMode):
    """Within it, the bytes of live tensor storages and their peak: every storage an op
    makes, and those of the tensors given at the start, from creation until freed."""

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__()
        # live storages: their bytes, and a reference whose callback counts them freed
        self.live: dict[int, tuple[int, weakref.ref[Any]]] = {}
        self.current = self.peak = 0
        for tensor in existing:
            self._track(tensor)

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        size = storage.nbytes()
        self.live[key] = size, weakref.ref(storage, partial(self._freed, key))
        self.current += size
        self.peak = max(self.peak, self.current)

    def _freed(self, key: int, _: object) -> None:
        freed = self.live.pop(key, None)
        if freed is not None:
            self.current -= freed[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self._track(value)
        return out


def peak_of_rank(case: Case) -> dict[str, Any]:
    """On one worker: train ``case`` for three steps, the last two tracked; the peak and
    what stays between steps (weights, gradients, optimizer state)."""
    model = build_model(MODEL, seed=0, n_layers=case.layers)
    options = {"virtual": case.virtual} if case.virtual > 1 else {}
    pipe = pipetrain.Pipeline(
        model,
        loss_fn=loss_function(MODEL),
        optimizer=partial(torch.optim.Adam, lr=1e-3),
        config=PipelineConfig(
            schedule=case.schedule,
            microbatches=case.microbatches,
            schedule_options=options,
            balance=case.balance,
            recompute=case.recompute,
        ),
    )
    batch, labels = next(BatchStream(MODEL, case.batch_size, seed=0))
    inputs = batch if 0 in pipe.stages else None
    targets = labels if case.chunks - 1 in pipe.stages else None
    pipe.train_step(inputs, targets)
    parameters = list(pipe.parameters())
    gradients = [p.grad for p in parameters if p.grad is not None]
    state = [
        value
        for per_parameter in (pipe.optimizer.state.values() if pipe.optimizer else [])
        for value in per_parameter.values()
        if isinstance(value, torch.Tensor)
    ]
    tracker = LiveBytes([*parameters, *gradients, *state])
    with tracker:
        for _ in range(2):
            pipe.train_step(inputs, targets)
    parts = {"weights": parameters, "gradients": gradients, "optimizer": state}
    return {
        "rank": pipe.rank,
        "peak": tracker.peak,
        "parts": {name: sum(t.nbytes for t in group) for name, group in parts.items()},
    }


def measure(case: Case) -> list[dict[str, Any]]:
    """Every rank's peak, by rank."""
    return launch(peak_of_rank, case.stages, case, threads_per_worker=1, timeout_s=600)


@functools.cache
def block_profile(microbatch_size: int) -> Profile:
    """The profile of a one-block GPT (embedding, block, head) at ``microbatch_size``."""
    model = build_model(MODEL, seed=0, n_layers=1)
    inputs, targets = next(BatchStream(MODEL, microbatch_size, seed=0))
    return pipetrain.profile(model, inputs, targets, loss_function(MODEL), repeats=1, warmup=0)


def deeper(base: Profile, layers: int) -> Profile:
    """``base`` (embedding, block, head) with the block repeated ``layers`` times."""
    embedding, block, head = base.layers
    copies: list[LayerCost] = [embedding, *([block] * layers), head]
    return Profile(copies, microbatch_size=base.microbatch_size, input_bytes=base.input_bytes)


def predicted(case: Case) -> list[float]:
    """The memory model's peak on every rank of ``case``, on the profile at the micro-batch
    size the runtime plays it at (a ``2bw`` step's two updates share the batch)."""
    family = spec(case.schedule)
    window = family.window(case.microbatches, family.resolve({}))
    base = block_profile(case.batch_size // window)
    starts = [0, *itertools.accumulate(case.balance)]
    layout = Layout(
        tuple((start, stop, 1) for start, stop in itertools.pairwise(starts)), case.virtual
    )
    candidate = Candidate(
        layout, case.schedule, case.microbatches, case.recompute, deeper(base, case.layers)
    )
    by_stage = candidate.memory()
    return [by_stage[candidate.chunks_of(rank)[0]] for rank in range(case.stages)]


def check(args: argparse.Namespace) -> None:
    """Part 1: measured peaks against the model, per schedule and recompute mode."""
    print(
        f"\nGPT, {args.layers} blocks on {args.stages} workers, batch {args.batch_size} in "
        f"{args.microbatches} micro-batches, Adam\n\n"
        "| schedule | recompute | highest rank | measured peak | predicted | predicted / "
        "measured | largest error over ranks | kept between steps (MiB) |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    for schedule, options in CHECKED:
        for recompute in ("never", "always"):
            case = Case(
                args.layers, args.stages, schedule, recompute, args.microbatches,
                args.batch_size, virtual=int(options.get("virtual", 1)),
            )  # fmt: skip
            ranks = measure(case)
            model = predicted(case)
            top = max(ranks, key=lambda rank: rank["peak"])
            errors = [model[r["rank"]] / r["peak"] - 1 for r in ranks]
            parts = ", ".join(
                f"{name} {value / MIB:.1f}" for name, value in top["parts"].items() if value
            )
            print(
                f"| {schedule} | {recompute} | {top['rank']} | {top['peak'] / MIB:.1f} MiB | "
                f"{model[top['rank']] / MIB:.1f} MiB | {model[top['rank']] / top['peak']:.3f} | "
                f"{max(errors, key=abs):+.1%} | {parts} |",
                flush=True,
            )


def deepest(stages: int, recompute: str, args: argparse.Namespace) -> str:
    """Part 2: the measured largest depth within the cap, as a table row."""
    cap = args.cap_mib * MIB

    def case(layers: int) -> Case:
        return Case(layers, stages, "gpipe", recompute, args.microbatches, args.batch_size)

    proposal = stages - 1  # a block on every stage at least
    while max(predicted(case(proposal + 1))) <= cap and proposal < 4096:
        proposal += 1
    peaks: dict[int, float] = {}

    def peak(layers: int) -> float:
        if layers not in peaks:
            print(f"  {stages} stages, {recompute}: {layers} blocks ...", file=sys.stderr)
            peaks[layers] = max(rank["peak"] for rank in measure(case(layers)))
        return peaks[layers]

    depth = max(proposal, stages)
    while depth > stages and peak(depth) > cap:
        depth -= 1
    if peak(depth) > cap:
        smallest = f"{stages} blocks: {peak(depth) / MIB:.1f} MiB"
        return f"| {stages} | {recompute} | {proposal} | none fits ({smallest}) | - | - |"
    while peak(depth + 1) <= cap:
        depth += 1
    return (
        f"| {stages} | {recompute} | {proposal} | {depth} | {peak(depth) / MIB:.1f} MiB | "
        f"{peak(depth + 1) / MIB:.1f} MiB |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="part 1: model against peaks")
    parser.add_argument("--depths", action="store_true", help="part 2: deepest within the cap")
    parser.add_argument("--cap-mib", type=float, default=48.0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--stages", type=int, default=4, help="part 1's workers")
    parser.add_argument("--layers", type=int, default=8, help="part 1's blocks")
    args = parser.parse_args()
    if not args.check and not args.depths:
        args.check = args.depths = True
    if args.check:
        check(args)
    if args.depths:
        print(
            f"\nGPipe, batch {args.batch_size} in {args.microbatches} micro-batches, Adam, "
            f"every worker within {args.cap_mib:g} MiB\n\n"
            "| stages | recompute | model's largest depth | measured largest depth (blocks) | "
            "its peak | one block more |\n|---|---|---|---|---|---|"
        )
        for recompute in ("never", "always"):
            for stages in (1, 2, 4):
                print(deepest(stages, recompute, args), flush=True)


if __name__ == "__main__":
    main()
