"""Step time and activation memory of the schedules since zero-bubble against 1F1B, measured
on 4 ranks and predicted by the simulator and the memory model.

Trains a model of ``--layers`` equal blocks (``Linear(width, width)`` then ``tanh``, mean
squared error against fixed random targets, Adam) on 4 CPU worker processes with 1 thread
each, with 1f1b and the six schedules since zero-bubble (zb-v, v-half, v-min, dualpipev,
looped-bfs, interleaved-zb) at ``--microbatches`` micro-batches of ``--microbatch-size``
samples. 8 blocks split into 4 stages of 2 (1f1b) or 8 chunks of 1 (the others, 2 per rank).
Every schedule's Pipeline lives in the same 4 processes, and they take steps in turn (the
order rotating from step to step), so all see the same machine load; each round starts new
processes. Every second step after warm-up each schedule also takes a recorded step
(untimed).

It prints a step's compute by the model's profile (every forward and backward, and the
optimizer step, timed in one process with 1 thread), over the cores the ranks can use: no
schedule can beat that on a machine with fewer cores than ranks. Then, per schedule:

- the median step time, its ratio to 1f1b's, and the simulator's makespan for the same
  schedule on the per-stage costs measured in that round's recorded steps
  (:func:`pipetrain.simulation.measured_costs`, overlapped pairs run back to back as the
  runtime runs them), with predicted over measured; and the same prediction from each
  action's mean duration instead of its median;
- per rank, the most chunk micro-batches whose activations the rank held at once: from
  the start of a forward to the end of the last backward pass that reads them (its W under
  a split backward, else its B), counted on the recorded timelines, on the simulated one,
  and by the memory model (:func:`pipetrain.planning.memory.in_flight`);
- per rank, the peak bytes of the tensors the blocks saved for their backward (autograd's
  saved tensors, counted once per tensor, parameters left out, held until autograd frees
  them), against the memory model's activations: in-flight chunk micro-batches times the
  chunk's stored activations (its input plus every layer's output, from
  :func:`pipetrain.profiler.profile`).

Times are medians over ``--rounds`` rounds, memory figures the most over every recorded
step.

    python benchmarks/bench_schedules.py [--rounds 3] [--steps 10] [--microbatches 8] \
        [--microbatch-size 32] [--width 1024] [--layers 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn

import pipetrain
from pipetrain.model.layers import stage_bounds
from pipetrain.planning.memory import StageFootprint, in_flight
from pipetrain.profiler import Profile, profile
from pipetrain.schedules import Schedule
from pipetrain.simulation import Costs, measured_costs, simulate
from pipetrain.timeline import Timeline

RANKS = 4
SCHEDULES = ("1f1b", "zb-v", "v-half", "v-min", "dualpipev", "looped-bfs", "interleaved-zb")
WARMUP = 2
RECORD_EVERY = 2
MIB = 2**20


@dataclass
class SavedBytes:
    """Bytes of the tensors this process's blocks saved for their backward, live and at peak.

    A tensor saved by several operations (a block's output, saved by its ``tanh`` and by the
    next block's ``Linear``) counts once, as long as any of them holds it.
    """

    live: int = 0
    peak: int = 0
    holders: dict[tuple[int, int], int] = field(default_factory=dict)

    def hold(self, tensor: torch.Tensor) -> tuple[int, int]:
        """Count ``tensor`` as saved; the key to :meth:`release` it by."""
        key = (tensor.data_ptr(), tensor.nbytes)
        if key not in self.holders:
            self.live += tensor.nbytes
            self.peak = max(self.peak, self.live)
        self.holders[key] = self.holders.get(key, 0) + 1
        return key

    def release(self, key: tuple[int, int]) -> None:
        """One saver of the tensor under ``key`` let it go."""
        self.holders[key] -= 1
        if not self.holders[key]:
            del self.holders[key]
            self.live -= key[1]


SAVED = SavedBytes()


class Saved:
    """What autograd keeps for a saved tensor: the tensor, released from :data:`SAVED` when
    autograd frees it."""

    __slots__ = ("key", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        """Hold ``tensor`` and count it."""
        self.tensor, self.key = tensor, SAVED.hold(tensor)

    def __del__(self) -> None:
        """Autograd freed the tensor."""
        SAVED.release(self.key)


class Block(nn.Module):
    """``tanh(Linear(x))``, counting the activations its backward keeps in :data:`SAVED`."""

    def __init__(self, width: int) -> None:
        """A square linear layer of ``width`` features."""
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block, with its saved tensors (but its weights) counted."""
        weights = {p.data_ptr() for p in self.parameters()}

        def pack(tensor: torch.Tensor) -> torch.Tensor | Saved:
            return tensor if tensor.data_ptr() in weights else Saved(tensor)

        def unpack(saved: torch.Tensor | Saved) -> torch.Tensor:
            return saved.tensor if isinstance(saved, Saved) else saved

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return torch.tanh(self.linear(x))


def model(layers: int, width: int) -> nn.Sequential:
    """``layers`` equal blocks, the same weights in every process."""
    torch.manual_seed(0)
    return nn.Sequential(*(Block(width) for _ in range(layers)))


def batch(samples: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed random inputs and targets."""
    generator = torch.Generator().manual_seed(1)
    return (
        torch.randn(samples, width, generator=generator),
        torch.randn(samples, width, generator=generator),
    )


def held_chunks(timeline: Timeline) -> list[int]:
    """Per rank, the most (stage, micro-batch) pairs held at once: from the start of the
    pair's forward to the end of its last backward pass (B, or W when it has one)."""
    peaks = []
    for rank in range(timeline.num_ranks):
        events = timeline.rank_events(rank)
        starts = {(e.stage, e.microbatch): e.start for e in events if e.kind == "F"}
        ends: dict[tuple[int | None, int | None], float] = {}
        for e in events:
            if e.kind in ("B", "W"):
                ends[(e.stage, e.microbatch)] = max(e.end, ends.get((e.stage, e.microbatch), 0.0))
        changes = sorted(
            [(end, -1) for end in ends.values()] + [(start, 1) for start in starts.values()]
        )  # at equal times a release comes before an acquisition
        held = peak = 0
        for _, change in changes:
            held += change
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def train(
    layers: int, width: int, microbatches: int, microbatch_size: int, steps: int
) -> dict[str, object]:
    """Worker: every schedule's Pipeline in this process, stepping in turn.

    Returns this rank's step times and peak saved bytes per schedule, and on rank 0 the
    recorded timelines (as dictionaries) and the schedules.
    """
    pipes = {
        name: pipetrain.Pipeline(
            model(layers, width),
            microbatches=microbatches,
            schedule=name,
            loss_fn=nn.functional.mse_loss,
            optimizer=lambda params: torch.optim.Adam(params, lr=1e-4),
        )
        for name in SCHEDULES
    }
    x, y = batch(microbatches * microbatch_size, width)
    times: dict[str, list[float]] = {name: [] for name in SCHEDULES}
    saved: dict[str, int] = dict.fromkeys(SCHEDULES, 0)
    timelines: dict[str, list[dict]] = {name: [] for name in SCHEDULES}
    for index in range(steps):
        turn = index % len(SCHEDULES)
        for name in SCHEDULES[turn:] + SCHEDULES[:turn]:
            pipe = pipes[name]
            dist.barrier()
            start = time.perf_counter()
            pipe.train_step(x, y)
            elapsed = time.perf_counter() - start
            if index < WARMUP:
                continue
            times[name].append(elapsed)
            if index % RECORD_EVERY == 0:
                pipe.recorder.enabled = True
                SAVED.peak = SAVED.live
                dist.barrier()
                pipe.train_step(x, y)
                saved[name] = max(saved[name], SAVED.peak)
                timeline = pipe.timeline()
                pipe.recorder.enabled = False
                if timeline is not None:
                    timelines[name].append(timeline.to_dict())
    result: dict[str, object] = {"times": times, "saved": saved}
    if dist.get_rank() == 0:
        result["timelines"] = timelines
        result["schedules"] = {name: pipe.schedule for name, pipe in pipes.items()}
        result["balance"] = {name: list(pipe.balance) for name, pipe in pipes.items()}
    return result


def mean_costs(timelines: Sequence[Timeline], schedule: Schedule) -> Costs:
    """:func:`pipetrain.simulation.measured_costs` with each stage's F, B, W and STEP, and
    the sends, at their mean duration instead of their median, so that the actions a rank
    took longer over (waiting for a core, say) count in full."""

    def mean(kind: str) -> list[float]:
        durations: list[list[float]] = [[] for _ in range(schedule.stages)]
        for timeline in timelines:
            for event in timeline.events:
                if event.kind == kind and event.stage is not None:
                    durations[event.stage].append(event.duration)
        return [statistics.mean(values) if values else 0.0 for values in durations]

    sends = [e.duration for t in timelines for e in t.events if e.kind.startswith("SEND_")]
    return replace(
        measured_costs(timelines, schedule.stages),
        forward_s=mean("F"),
        backward_s=mean("B"),
        weight_s=mean("W"),
        step_s=mean("STEP"),
        send_s=statistics.mean(sends) if sends else 0.0,
    )


def memory_model(
    name: str, schedule: Schedule, balance: Sequence[int], measured: Profile
) -> list[tuple[int, float]]:
    """Per rank, the memory model's in-flight chunk micro-batches and its activation bytes
    without recomputation: that count times the mean stored activations of the rank's
    chunks (each its input plus every layer's output, from the profile), as
    :func:`pipetrain.planning.memory.worker_memory` charges them."""
    bounds = stage_bounds(balance)
    per_rank = []
    for rank in range(RANKS):
        chunks = [
            StageFootprint.of(measured, *bounds[stage]).activation_bytes
            for stage, ranks in enumerate(schedule.stage_ranks)
            if rank in ranks
        ]
        count = in_flight(name, rank, schedule.microbatches, [1] * RANKS, len(chunks))
        per_rank.append((count, count * sum(chunks) / len(chunks)))
    return per_rank


def profiled(layers: int, width: int, microbatch_size: int) -> Profile:
    """The model's profile at the micro-batch size, in this process with 1 thread: its
    activation sizes and the compute a step needs."""
    torch.set_num_threads(1)
    x, y = batch(microbatch_size, width)
    return profile(model(layers, width), x, y, nn.functional.mse_loss)


def step_compute(measured: Profile, microbatches: int) -> float:
    """Seconds of compute in one step by the profile: every micro-batch's forward and
    backward through every layer, and the optimizer step."""
    return sum(
        microbatches * (layer.forward_s + layer.backward_s) + layer.optimizer_s
        for layer in measured.layers
    )


def per_rank_max(runs: Sequence[Sequence[int]]) -> list[int]:
    """Each rank's largest value over several runs' per-rank values."""
    return [max(values) for values in zip(*runs)]


def listed(values: Iterable[float]) -> str:
    """Comma-separated values: integers as they are, other numbers to 2 decimals."""
    return ", ".join(str(v) if isinstance(v, int) else f"{v:.2f}" for v in values)


def main() -> None:
    """Run the rounds and print both tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    measured: dict[str, list[float]] = {name: [] for name in SCHEDULES}
    predicted: dict[str, list[float]] = {name: [] for name in SCHEDULES}
    from_means: dict[str, list[float]] = {name: [] for name in SCHEDULES}
    held: dict[str, list[list[int]]] = {name: [] for name in SCHEDULES}
    simulated_held: dict[str, list[list[int]]] = {name: [] for name in SCHEDULES}
    saved: dict[str, list[list[int]]] = {name: [] for name in SCHEDULES}
    started = time.perf_counter()
    for _ in range(args.rounds):
        results = pipetrain.launch(
            train,
            RANKS,
            args.layers,
            args.width,
            args.microbatches,
            args.microbatch_size,
            args.steps,
            threads_per_worker=1,
        )
        first = results[0]
        for name in SCHEDULES:
            measured[name].append(statistics.median(first["times"][name]))
            timelines = [Timeline.from_dict(t) for t in first["timelines"][name]]
            schedule = first["schedules"][name]
            simulated = simulate(schedule, measured_costs(timelines, schedule.stages))
            predicted[name].append(simulated.makespan)
            from_means[name].append(simulate(schedule, mean_costs(timelines, schedule)).makespan)
            held[name] += [held_chunks(timeline) for timeline in timelines]
            simulated_held[name].append(held_chunks(simulated))
            saved[name].append([result["saved"][name] for result in results])
    measured_profile = profiled(args.layers, args.width, args.microbatch_size)
    elapsed = time.perf_counter() - started
    compute, cores = step_compute(measured_profile, args.microbatches), os.cpu_count() or 1
    print(
        f"{args.layers} blocks of width {args.width}, {args.microbatches} micro-batches of "
        f"{args.microbatch_size}, {RANKS} processes x 1 thread, steps in turn, median of "
        f"{args.rounds} rounds ({elapsed:.0f} s). A step's compute by the profile (1 thread, "
        f"alone): {compute * 1e3:.1f} ms, over min({RANKS} ranks, {cores} cores): "
        f"{compute / min(RANKS, cores) * 1e3:.1f} ms\n"
    )
    print(
        "| schedule | step ms | vs 1f1b | predicted ms | predicted / measured | "
        "predicted from means, ms | from means / measured |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = statistics.median(measured["1f1b"])
    for name in SCHEDULES:
        step = statistics.median(measured[name])
        guess, mean_guess = statistics.median(predicted[name]), statistics.median(from_means[name])
        print(
            f"| {name} | {step * 1e3:.1f} | {base / step:.2f} | {guess * 1e3:.1f} | "
            f"{guess / step:.2f} | {mean_guess * 1e3:.1f} | {mean_guess / step:.2f} |"
        )
    print(
        "\nPer rank, the most over every recorded step and round:\n\n"
        "| schedule | chunk micro-batches held: measured | simulated | memory model | "
        "saved activations, MiB: measured | memory model | predicted / measured |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in SCHEDULES:
        counts, predicted_bytes = zip(
            *memory_model(name, first["schedules"][name], first["balance"][name], measured_profile)
        )
        measured_bytes = per_rank_max(saved[name])
        print(
            f"| {name} | {listed(per_rank_max(held[name]))} | "
            f"{listed(per_rank_max(simulated_held[name]))} | {listed(counts)} | "
            f"{listed(b / MIB for b in measured_bytes)} | "
            f"{listed(b / MIB for b in predicted_bytes)} | "
            f"{listed(p / m for p, m in zip(predicted_bytes, measured_bytes))} |"
        )


if __name__ == "__main__":
    main()
