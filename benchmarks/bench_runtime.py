"""pipetrain vs torch.distributed.pipelining vs no pipeline, on the same model, split and schedule.

Trains the built-in GPT (or another built-in model) split into 2 stages, with GPipe and
1F1B, once with pipetrain and once with torch.distributed.pipelining (ScheduleGPipe /
Schedule1F1B), each on 2 CPU worker processes with 1 thread; plus the unpipelined model in
one process with 1 thread. For pipetrain it also simulates the schedule on the per-stage
costs measured in the same run and prints the prediction beside the measured step time.

Machine load drifts over minutes, so pipetrain and torch run in the same two processes,
step by step in turn, and the whole comparison repeats for ``--rounds`` rounds (new
processes each); each figure is the median over its rounds.

    python benchmarks/bench_runtime.py [--model gpt] [--steps 30] [--microbatches 4] \
        [--batch-size 32] [--rounds 3]
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
from pipetrain.model.layers import StageModule, stage_bounds, to_layers
from pipetrain.simulation import measured_costs, simulate
from pipetrain.timeline import Timeline

WARMUP = 5


def _batches(model_name: str, batch_size: int, steps: int) -> list:
    stream = BatchStream(model_name, batch_size, seed=0)
    return [next(stream) for _ in range(steps)]


def run_both(
    model_name: str, schedule: str, microbatches: int, batch_size: int, steps: int
) -> dict:
    """Worker: pipetrain and torch.distributed.pipelining on the same split, in the same two
    processes, step by step in turn, so that both see the same machine load.

    Every third step pipetrain also runs a recorded (untimed) step, whose timeline gives the
    measured costs for the prediction.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, world = dist.get_rank(), dist.get_world_size()
    loss_fn = loss_function(model_name)
    pipe = pipetrain.Pipeline(
        build_model(model_name),
        microbatches=microbatches,
        schedule=schedule,
        loss_fn=loss_fn,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
    )
    layers = to_layers(build_model(model_name))
    module = StageModule(layers[slice(*stage_bounds(pipe.balance)[rank])])
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    kind = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    runner = kind(
        PipelineStage(module, rank, world, torch.device("cpu")), microbatches, loss_fn=loss_fn
    )

    def torch_step(x, y) -> None:
        optimizer.zero_grad()
        if rank == 0:
            runner.step(x)
        elif rank == world - 1:
            runner.step(target=y, losses=[])
        else:
            runner.step()
        optimizer.step()

    ours, theirs, timelines = [], [], []
    for index, (x, y) in enumerate(_batches(model_name, batch_size, steps)):
        for timings, step in ((ours, pipe.train_step), (theirs, torch_step)):
            dist.barrier()
            start = time.perf_counter()
            step(x, y)
            if index >= WARMUP:
                timings.append(time.perf_counter() - start)
        if index >= WARMUP and index % 3 == 0:
            pipe.recorder.enabled = True
            dist.barrier()
            pipe.train_step(x, y)
            timeline = pipe.timeline()
            pipe.recorder.enabled = False
            if timeline is not None:
                timelines.append(timeline.to_dict())
    return {"ours": ours, "theirs": theirs, "timelines": timelines}


def run_unpipelined(model_name: str, batch_size: int, steps: int) -> list[float]:
    """The whole model in this process, one thread."""
    torch.set_num_threads(1)
    model = StageModule(to_layers(build_model(model_name)))
    loss_fn = loss_function(model_name)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    times = []
    for x, y in _batches(model_name, batch_size, steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times


def steady(times: list[float]) -> float:
    """Median step time after warm-up."""
    return statistics.median(times[WARMUP:])


def main() -> None:
    """Run every configuration and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    common = (args.microbatches, args.batch_size, args.steps)
    baseline = statistics.median(
        steady(run_unpipelined(args.model, args.batch_size, args.steps)) for _ in range(args.rounds)
    )
    print(
        f"{args.model}, batch {args.batch_size}, {args.microbatches} micro-batches, 2 stages, "
        f"2 processes x 1 thread, steps in turn, median of {args.rounds} rounds"
    )
    print(
        f"{'run':34} {'step ms':>9} {'vs unpipelined':>15} {'vs torch':>9} {'predicted ms':>13} "
        f"{'pred/meas':>10}"
    )
    print(f"{'unpipelined (1 process)':34} {baseline * 1e3:9.2f} {1.0:15.2f}")
    for schedule in ("gpipe", "1f1b"):
        ours_runs, theirs_runs, predictions = [], [], []
        for _ in range(args.rounds):
            result = pipetrain.launch(
                run_both, 2, args.model, schedule, *common, threads_per_worker=1
            )[0]
            ours_runs.append(statistics.median(result["ours"]))
            theirs_runs.append(statistics.median(result["theirs"]))
            costs = measured_costs([Timeline.from_dict(t) for t in result["timelines"]], 2)
            predictions.append(
                simulate(pipetrain.schedules.build(schedule, 2, args.microbatches), costs).makespan
                / ours_runs[-1]
            )
        ours_s, theirs_s, ratio = (
            statistics.median(v) for v in (ours_runs, theirs_runs, predictions)
        )
        print(
            f"{'pipetrain ' + schedule:34} {ours_s * 1e3:9.2f} {baseline / ours_s:15.2f} "
            f"{theirs_s / ours_s:9.2f} {ratio * ours_s * 1e3:13.2f} {ratio:10.2f}"
        )
        print(
            f"{'torch.distributed.pipelining ' + schedule:34} {theirs_s * 1e3:9.2f} "
            f"{baseline / theirs_s:15.2f} {1.0:9.2f}"
        )
        speedups = ", ".join(f"{t / o:.2f}" for o, t in zip(ours_runs, theirs_runs))
        print(
            f"{'':34} per round, torch/pipetrain: {speedups}; "
            f"predicted/measured: {', '.join(f'{r:.2f}' for r in predictions)}"
        )
    print("'vs unpipelined' and 'vs torch' are speedups (>1 means this run is faster).")


if __name__ == "__main__":
    main()
