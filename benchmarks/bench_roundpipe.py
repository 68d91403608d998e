"""RoundPipe against 1F1B and ZB-V on the same workers and model: step time, bubble measured
and predicted; and a worker's memory under ``roundpipe`` against its share of the model.

(a) Speed (default): the built-in GPT (``--layers`` blocks of width ``--d-model``, context
``--context``) on 2 CPU worker processes with 1 thread each, ``--microbatches``
micro-batches of ``--rows`` sequences, Adam. Schedules: ``1f1b`` (2 stages), ``zb-v`` (4
chunks, two a rank) and ``roundpipe`` with 4 and 8 model stages (prefetching one stage).
Every schedule's Pipeline lives in the same processes and they take steps in turn (the order
rotating each step), so all see the same load; each round starts new processes. Per
schedule: the median step, its ratio to 1f1b's, the measured bubble (rank time outside F,
B, W and STEP, over the recorded steps), and the simulator's step and bubble for the same
schedule on the costs measured in that round's recorded steps
(:func:`pipetrain.simulation.measured_costs`), with predicted over measured.

(b) Memory (``--memory``): a GPT whose weights, gradients and Adam state (16 bytes a
parameter) exceed ``--worker-memory``, built on the meta device and trained (recomputing
each stage's activations in its backward, ``--recompute``) under
``roundpipe`` and under ``1f1b``, each also with a GPT of blocks of width 8 (the floor:
what the interpreter, torch, gloo and the runtime hold whatever the model). Per worker, the
peak resident set (``VmHWM``) less the floor's, against the limit, and the host store's
bytes in the process (its mappings, by name in ``/proc/self/maps``) against the model's;
then :func:`pipetrain.plan` of the same model on the same workers under the same limit,
with the reason each other family was rejected.

    python benchmarks/bench_roundpipe.py [--rounds 3] [--steps 10] [--microbatches 8]
    python benchmarks/bench_roundpipe.py --memory [--worker-memory 200MB] [--layers 12]
        [--d-model 512] [--model-stages 14] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import pipetrain
from pipetrain.app.models.gpt import build_gpt, gpt_loss
from pipetrain.profiler import profile
from pipetrain.simulation import measured_costs, simulate
from pipetrain.timeline import Timeline
from pipetrain.units import parse_bytes

WORKERS, WARMUP, RECORD_EVERY, MIB = 2, 2, 2, 2**20
SCHEDULES: dict[str, dict[str, int]] = {
    "1f1b": {},
    "zb-v": {},
    "roundpipe-4": {"model_stages": 4},
    "roundpipe-8": {"model_stages": 8},
}
VOCAB = 256


def family(name: str) -> str:
    """The schedule family behind a row's name (``roundpipe-4`` is ``roundpipe``)."""
    return name.split("-")[0] if name.startswith("roundpipe") else name


def gpt(layers: int, d_model: int, context: int) -> torch.nn.Sequential:
    """The built-in GPT, the same weights in every process."""
    torch.manual_seed(0)
    return build_gpt(d_model=d_model, heads=4, n_layers=layers, context=context, vocab=VOCAB)


def tokens(rows: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed random inputs and next-token targets."""
    generator = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (rows, context + 1), generator=generator)
    return data[:, :-1], data[:, 1:]


def adam(params: Any) -> torch.optim.Optimizer:
    """The optimizer every run uses."""
    return torch.optim.Adam(params, lr=1e-4)


def speed_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Worker: every schedule's Pipeline in this process, stepping in turn; this rank's step
    times and, on rank 0, the recorded timelines and the schedules."""
    pipes = {
        name: pipetrain.Pipeline(
            gpt(args.layers, args.d_model, args.context),
            loss_fn=gpt_loss,
            optimizer=adam,
            config=pipetrain.PipelineConfig(
                schedule=family(name), microbatches=args.microbatches, schedule_options=options
            ),
        )
        for name, options in SCHEDULES.items()
    }
    x, y = tokens(args.microbatches * args.rows, args.context)
    names = list(SCHEDULES)
    times: dict[str, list[float]] = {name: [] for name in names}
    timelines: dict[str, list[dict]] = {name: [] for name in names}
    for index in range(args.steps):
        turn = index % len(names)
        for name in names[turn:] + names[:turn]:
            pipe = pipes[name]
            dist.barrier()
            start = time.perf_counter()
            pipe.train_step(x, y)
            if index < WARMUP:
                continue
            times[name].append(time.perf_counter() - start)
            if index % RECORD_EVERY == 0:
                pipe.recorder.enabled = True
                dist.barrier()
                pipe.train_step(x, y)
                timeline = pipe.timeline()
                pipe.recorder.enabled = False
                if timeline is not None:
                    timelines[name].append(timeline.to_dict())
    result: dict[str, Any] = {"times": times}
    if dist.get_rank() == 0:
        result["timelines"] = timelines
        result["schedules"] = {name: pipe.schedule for name, pipe in pipes.items()}
    return result


def speed(args: argparse.Namespace) -> None:
    """Part (a): run the rounds and print the table."""
    rows: dict[str, dict[str, list[float]]] = {
        name: {"step": [], "bubble": [], "predicted": [], "predicted_bubble": []}
        for name in SCHEDULES
    }
    started = time.perf_counter()
    for _ in range(args.rounds):
        first = pipetrain.launch(speed_worker, WORKERS, args, threads_per_worker=1)[0]
        for name, row in rows.items():
            schedule = first["schedules"][name]
            recorded = [Timeline.from_dict(t) for t in first["timelines"][name]]
            simulated = simulate(schedule, measured_costs(recorded, schedule.stages))
            row["step"].append(statistics.median(first["times"][name]))
            row["bubble"].append(statistics.median(t.bubble_fraction for t in recorded))
            row["predicted"].append(simulated.makespan)
            row["predicted_bubble"].append(simulated.bubble_fraction)
    print(
        f"GPT of {args.layers} blocks, d_model {args.d_model}, context {args.context}; "
        f"{args.microbatches} micro-batches of {args.rows} rows; {WORKERS} processes x 1 "
        f"thread, steps in turn; median of {args.rounds} rounds "
        f"({time.perf_counter() - started:.0f} s)\n"
    )
    print(
        "| schedule | step ms | 1f1b / it | bubble measured | predicted ms | "
        "predicted / measured | bubble predicted | per round, predicted / measured |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    base = statistics.median(rows["1f1b"]["step"])
    for name, row in rows.items():
        step, guess = statistics.median(row["step"]), statistics.median(row["predicted"])
        ratios = ", ".join(f"{p / s:.2f}" for p, s in zip(row["predicted"], row["step"]))
        print(
            f"| {name} | {step * 1e3:.1f} | {base / step:.2f} | "
            f"{statistics.median(row['bubble']):.3f} | {guess * 1e3:.1f} | {guess / step:.2f} | "
            f"{statistics.median(row['predicted_bubble']):.3f} | {ratios} |"
        )


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` figure (``VmHWM``, ``VmRSS``, ``RssShmem``) in bytes."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def store_bytes() -> int:
    """Bytes of this process's host-store mappings (the store's files, unlinked once
    mapped, appear in ``/proc/self/maps`` by name)."""
    total = 0
    with open("/proc/self/maps", encoding="utf-8") as maps:
        for line in maps:
            if "pipetrain-store-" in line:
                start, end = (int(part, 16) for part in line.split()[0].split("-"))
                total += end - start
    return total


def memory_worker(
    args: argparse.Namespace,
    schedule: str,
    size: tuple[int, int],
    planned: pipetrain.Plan | None = None,
) -> dict[str, int]:
    """Worker: the GPT of ``size`` (blocks, width), built on the meta device, trained for
    ``--steps`` steps under ``schedule`` (or as ``planned``); this process's peak resident
    set, its private part at the end and the host store's bytes here."""
    layers, width = size
    x, y = tokens(args.microbatches * args.rows, args.context)
    with torch.device("meta"):
        model = build_gpt(
            d_model=width, heads=4, n_layers=layers, context=args.context, vocab=VOCAB
        )
    options = {"model_stages": args.model_stages} if schedule == "roundpipe" else {}
    config = pipetrain.PipelineConfig(
        schedule=schedule,
        microbatches=args.microbatches,
        schedule_options=options,
        recompute=args.recompute,
    )
    if planned is not None:
        config = pipetrain.PipelineConfig.from_plan(planned)
    pipe = pipetrain.Pipeline(model, loss_fn=gpt_loss, optimizer=adam, config=config)
    for _ in range(args.steps):
        pipe.train_step(x, y)
    return {
        "peak": status_bytes("VmHWM"),
        "private": status_bytes("RssAnon"),
        "store": store_bytes(),
    }


def memory(args: argparse.Namespace) -> None:
    """Part (b): each worker's peak under roundpipe and 1f1b, and under the layout the
    planner chooses for the limit, over a floor run of a tiny GPT (what the interpreter,
    torch, gloo and the runtime take whatever the model); the host store's size; the
    planner's verdict, with the reason each other family was rejected."""
    limit = parse_bytes(args.worker_memory)
    with torch.device("meta"):
        model = gpt(args.layers, args.d_model, args.context)
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    state = 4 * parameters  # weights, gradients and Adam's two moments
    print(
        f"GPT of {args.layers} blocks, d_model {args.d_model}: weights {parameters / MIB:.1f} "
        f"MiB; weights + gradients + Adam {state / MIB:.1f} MiB; limit per worker "
        f"{limit / MIB:.1f} MiB; {WORKERS} workers, 1 thread each; roundpipe with "
        f"{args.model_stages} stages; {args.microbatches} micro-batches of {args.rows} x "
        f"{args.context} tokens; recompute {args.recompute}; {args.steps} steps\n"
    )
    real = gpt(args.layers, args.d_model, args.context)
    x, y = tokens(args.rows, args.context)
    measured = profile(real, x, y, gpt_loss)
    chosen: pipetrain.Plan | None = None
    try:
        chosen = pipetrain.plan(
            measured, workers=WORKERS, memory_limit=limit, microbatches=(args.microbatches,)
        )
        print(f"plan under the limit:\n{chosen.describe()}\n")
    except ValueError as refused:
        print(f"no plan under the limit: {refused}\n")
    tiny = (max(1, args.model_stages - 2), 8)  # as many layers as roundpipe has stages
    sizes = {"roundpipe": tiny, "1f1b": tiny}
    if chosen is not None:  # the floor keeps the plan's split: the model's layer count
        sizes["planned"] = (args.layers, 8)
    runs = {
        (name, size): pipetrain.launch(
            memory_worker,
            WORKERS,
            args,
            name,
            size,
            chosen if name == "planned" else None,
            threads_per_worker=1,
            timeout_s=600,
        )
        for name, floor in sizes.items()
        for size in (floor, (args.layers, args.d_model))
    }
    print(
        "| schedule | worker | peak RSS MiB | floor MiB | peak over the floor MiB "
        "| within the limit | predicted MiB | private RSS at the end MiB | host store MiB |"
    )
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|")
    for name, floor_size in sizes.items():
        floor, full = runs[(name, floor_size)], runs[(name, (args.layers, args.d_model))]
        planned = chosen if name == "planned" else None
        predicted = "" if planned is None else predicted_peaks(planned)
        label = name if planned is None else f"{planned.schedule}, as planned"
        for rank, (low, high) in enumerate(zip(floor, full)):
            net = high["peak"] - low["peak"]
            print(
                f"| {label} | {rank} | {high['peak'] / MIB:.1f} | {low['peak'] / MIB:.1f} | "
                f"{net / MIB:.1f} | {'yes' if net <= limit else 'no'} | {predicted} | "
                f"{high['private'] / MIB:.1f} | {high['store'] / MIB:.1f} |"
            )
    stored = sum(r["store"] for r in runs[("roundpipe", (args.layers, args.d_model))])
    print(
        f"\nroundpipe's host store over every worker: {stored / MIB:.1f} MiB "
        f"({stored / state:.2f} x the weights, gradients and Adam state)"
    )


def predicted_peaks(chosen: pipetrain.Plan) -> str:
    """The plan's predicted peaks of a worker, MiB (lowest to highest)."""
    low, high = min(chosen.stage_memory_bytes), max(chosen.stage_memory_bytes)
    return f"{low / MIB:.1f}" if low == high else f"{low / MIB:.1f}-{high / MIB:.1f}"


def main() -> None:
    """Parse the arguments and run a part."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", action="store_true", help="part (b) instead of (a)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--model-stages", type=int, default=8)
    parser.add_argument("--worker-memory", default="200MB")
    parser.add_argument(
        "--recompute", default="always", help="part (b)'s re-materialization mode, both schedules"
    )
    args = parser.parse_args()
    memory(args) if args.memory else speed(args)


if __name__ == "__main__":
    main()
