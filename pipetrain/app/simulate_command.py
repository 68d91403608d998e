"""``pipetrain simulate``: its arguments, and the simulated step printed as text or JSON."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pipetrain.app.arguments import (
    add_schedule_options,
    non_negative_float,
    output_path,
    positive_int,
    schedule_options,
    write_timeline,
)
from pipetrain.app.simulate_job import COST_FIELDS, run_simulation
from pipetrain.schedules import Schedule, names
from pipetrain.units import counted, format_seconds


def add_simulate(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "simulate",
        help="play a schedule against per-stage costs and report makespan and bubble",
        description=(
            "Simulate one step of a schedule, by name or from a file of written actions (as "
            "Schedule.describe() prints them). Costs are seconds per micro-batch and stage (with "
            "several chunks per rank: per rank, shared equally by its chunks). Defaults are the "
            "schedule's: forward 1, backward 2, weight 0; for zb-h1 forward = backward = weight "
            "= 1, as in the zero-bubble paper. Flags override a costs file."
        ),
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--schedule",
        choices=names(),
        metavar="NAME",
        help=f"one of {', '.join(names())}",
    )
    source.add_argument(
        "--schedule-file",
        metavar="FILE",
        help="a schedule written as text: 'rank R: F0.0 F0.1 B0.0 ...' lines, as describe() prints",
    )
    parser.add_argument("--ranks", type=positive_int, metavar="P", help="pipeline ranks")
    parser.add_argument(
        "--microbatches",
        type=positive_int,
        metavar="M",
        help="micro-batches per step (pipedream: mini-batches in the window; 2bw: per update)",
    )
    add_schedule_options(parser)
    parser.add_argument(
        "--forward", type=non_negative_float, metavar="T", help="forward time per micro-batch"
    )
    parser.add_argument(
        "--backward",
        type=non_negative_float,
        metavar="T",
        help="backward (input-gradient) time per micro-batch",
    )
    parser.add_argument(
        "--weight",
        type=non_negative_float,
        metavar="T",
        help="weight-gradient time per micro-batch (a separate W where the backward is split)",
    )
    parser.add_argument(
        "--costs",
        metavar="FILE.json",
        help=f"JSON object with Costs fields ({', '.join(COST_FIELDS)}); a number or one per stage",
    )
    parser.add_argument(
        "--out",
        type=output_path,
        metavar="PATH",
        help="write the timeline: .png chart or .json Chrome trace",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run_simulate(args: argparse.Namespace) -> None:
    schedule = None
    if args.schedule_file:
        schedule = _read_schedule(args.schedule_file)
        if args.ranks or args.microbatches or schedule_options(args):
            raise ValueError(
                "--schedule-file gives ranks, micro-batches and options itself; "
                "drop --ranks, --microbatches and schedule options"
            )
    elif args.ranks is None or args.microbatches is None:
        raise ValueError("--schedule needs --ranks and --microbatches")
    result = run_simulation(
        args.schedule,
        args.ranks,
        args.microbatches,
        options=schedule_options(args),
        schedule=schedule,
        costs_file=args.costs,
        forward_s=args.forward,
        backward_s=args.backward,
        weight_s=args.weight,
    )
    timeline, schedule = result.timeline, result.schedule
    if args.out:
        write_timeline(
            timeline,
            args.out,
            f"{schedule.name}, {counted(schedule.num_ranks, 'rank')}, "
            f"{counted(result.microbatches, 'micro-batch', 'micro-batches')}",
        )
    if args.json:
        print(json.dumps(result.to_json()))
        return
    chunks = f" ({schedule.stages} model stages)" if schedule.stages != schedule.num_ranks else ""
    window = (
        f" ({schedule.microbatches} in the window)"
        if schedule.microbatches != result.microbatches
        else ""
    )
    bubble = f"{timeline.bubble_fraction:.1%}"
    if result.textbook:
        formula, value = result.textbook
        bubble += f"   (textbook {formula} = {value:.1%})"
    print(
        f"{schedule.name}: {counted(schedule.num_ranks, 'rank')}{chunks}, "
        f"{counted(result.microbatches, 'micro-batch', 'micro-batches')}{window}"
    )
    print(f"  costs             {_describe_costs(result.requested, schedule)}")
    print(f"  makespan          {format_seconds(timeline.makespan)}")
    print(f"  bubble fraction   {bubble}")
    print(
        f"  peak activations  {timeline.peak_activations} "
        "(most (stage, micro-batch) activations held, per rank)"
    )
    if args.out:
        print(f"  timeline written  {args.out}")


def _read_schedule(path: str) -> Schedule:
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except OSError as error:
        raise ValueError(f"cannot read schedule file {path!r}: {error.strerror}") from None
    return Schedule.from_text(text)


def _describe_costs(values: dict[str, Any], schedule: Schedule) -> str:
    labels = {
        "forward_s": "F",
        "backward_s": "B",
        "weight_s": "W",
        "step_s": "step",
        "allreduce_s": "all-reduce",
        "gather_s": "gather",
        "load_s": "load per stage",
        "offload_s": "offload per stage",
        "latency_s": "latency",
        "send_s": "send",
        "receive_s": "receive",
        "activation_bytes": "activation bytes",
        "bandwidth": "bandwidth",
    }
    parts = [
        f"{label} {values[name]:g}"
        if isinstance(values[name], (int, float))
        else f"{label} {values[name]}"
        for name, label in labels.items()
        if values.get(name)
    ]
    if schedule.stages == schedule.num_ranks:
        return ", ".join(parts) + " (times in seconds per micro-batch and stage)"
    return (
        ", ".join(parts)
        + " (times in seconds per micro-batch and rank, shared by its "
        + f"{schedule.stages // schedule.num_ranks} chunks)"
    )
