"""How much of a measured step do median action times explain, and how much their variation?

Trains the built-in ``uneven-mlp`` split [5, 3] on 2 CPU worker processes (1 thread each,
1F1B, 4 micro-batches of 32, Adam) and records every step's timeline. From those
timelines it simulates the step three ways and prints each beside the measured step:

- every action at its median over the run (``pipetrain.simulation.measured_costs``);
- the median of 256 simulated steps whose forwards and backwards each draw a duration
  measured in the run (``pipetrain.simulation.Variation``, factors over the medians);
- the run replayed: every step simulated with its own measured action durations, which
  checks the simulator's logic itself.

    python benchmarks/bench_variation.py [--steps 60]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import pipetrain
from pipetrain.app.data import BatchStream
from pipetrain.app.models import build_model, loss_function
from pipetrain.schedules import build
from pipetrain.simulation import Variation, measured_costs, median_makespan, simulate
from pipetrain.timeline import Timeline

MODEL = "uneven-mlp"
BALANCE = [5, 3]
MICROBATCHES = 4
WARMUP = 5


def train(steps: int) -> tuple[list[float], list[Timeline]]:
    """Worker: each step's wall time (without recording) and, in a second pass, its timeline."""
    stream = BatchStream(MODEL, 128, seed=0)
    walls, timelines = [], []
    for record in (False, True):
        pipe = pipetrain.Pipeline(
            build_model(MODEL),
            balance=BALANCE,
            microbatches=MICROBATCHES,
            schedule="1f1b",
            loss_fn=loss_function(MODEL),
            optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
            runtime=pipetrain.RuntimeConfig(record=record),
        )
        for _ in range(steps):
            x, y = next(stream)
            dist.barrier()
            start = time.perf_counter()
            pipe.train_step(x, y)
            if not record:
                walls.append(time.perf_counter() - start)
            else:
                timelines.append(pipe.timeline())
    return walls[WARMUP:], timelines[WARMUP:]


def replay(timeline: Timeline, latency_s: float, receive_s: float) -> float:
    """The makespan of ``timeline``'s actions, each at its measured duration, played in order
    with receives waiting for their sends (plus ``latency_s``) as the simulator does."""
    lanes = {
        rank: sorted(timeline.rank_events(rank), key=lambda e: e.start)
        for rank in range(timeline.num_ranks)
    }
    clock = dict.fromkeys(lanes, 0.0)
    position = dict.fromkeys(lanes, 0)
    sent: dict[tuple[str, int, int], float] = {}
    progressed = True
    while progressed:
        progressed = False
        for rank, events in lanes.items():
            while position[rank] < len(events):
                event = events[position[rank]]
                if event.kind in ("RECV_F", "RECV_B"):
                    source = (
                        ("SEND_F", event.stage - 1)
                        if event.kind == "RECV_F"
                        else ("SEND_B", event.stage + 1)
                    )
                    if (*source, event.microbatch) not in sent:
                        break
                    clock[rank] = (
                        max(clock[rank], sent[(*source, event.microbatch)] + latency_s) + receive_s
                    )
                else:
                    clock[rank] += event.duration
                    if event.kind in ("SEND_F", "SEND_B"):
                        sent[(event.kind, event.stage, event.microbatch)] = clock[rank]
                position[rank] += 1
                progressed = True
    return max(clock.values())


def main() -> None:
    """Record a run, simulate it three ways, print each against the measured step."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    walls, timelines = pipetrain.launch(train, 2, args.steps, threads_per_worker=1)[0]
    stages = len(BALANCE)
    costs = measured_costs(timelines, stages)
    schedule = build("1f1b", stages, MICROBATCHES)

    def factors(kind: str) -> list[list[float]]:
        durations = [
            [e.duration for t in timelines for e in t.events if e.kind == kind and e.stage == s]
            for s in range(stages)
        ]
        return [[d / statistics.median(values) for d in values] for values in durations]

    variation = Variation(factors("F"), factors("B"))
    makespan = statistics.median(t.makespan for t in timelines)
    wall = statistics.median(walls)
    rows = [
        ("every action at its median", simulate(schedule, costs).makespan),
        (
            "forward/backward drawn from the run (median of 256)",
            median_makespan(schedule, costs, variation, runs=256),
        ),
        (
            "each step replayed at its own durations (median)",
            statistics.median(replay(t, costs.latency_s, costs.receive_s) for t in timelines),
        ),
    ]
    print(
        f"measured: step {wall * 1e3:.2f} ms (train_step, not recording), "
        f"recorded makespan {makespan * 1e3:.2f} ms"
    )
    print(f"{'simulated':<52} {'ms':>7} {'/ makespan':>11} {'/ step':>7}")
    for name, value in rows:
        print(f"{name:<52} {value * 1e3:7.2f} {value / makespan:11.3f} {value / wall:7.3f}")


if __name__ == "__main__":
    main()
