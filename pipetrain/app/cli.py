"""The ``pipetrain`` command line: ``simulate`` a schedule, ``profile`` and ``plan`` a model,
``train`` a built-in model.

Each command is a pair of functions, ``_add_<command>`` (its arguments) and
``_run_<command>`` (its work and printing), listed in :data:`COMMANDS`. Errors a user can
cause print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from pipetrain.app.simulate_job import COST_FIELDS, run_simulation
from pipetrain.schedules import RECOMPUTE_MODES, Option, Schedule, ScheduleError, names, spec
from pipetrain.timeline import Timeline
from pipetrain.units import format_bytes, format_seconds

if TYPE_CHECKING:
    from pipetrain.planning import Plan

USAGE_ERROR = 2
RUN_FAILED = 1
INTERRUPTED = 130
# a copy of pipetrain.app.models.MODEL_NAMES (a test keeps them equal): importing the models
# loads torch, which `pipetrain simulate` does not need
MODEL_NAMES = ("mlp", "cnn", "gpt", "uneven-mlp")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr, without the usage block."""

    def error(self, message: str) -> NoReturn:
        """Print ``message`` on one line and exit with status 2."""
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """Parse an integer >= 1 (an argparse ``type``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (1 or more), got {value}")
    return value


def non_negative_float(text: str) -> float:
    """Parse a finite float >= 0 (an argparse ``type``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def output_path(text: str) -> str:
    """Accept a path ending in ``.png`` (Gantt chart) or ``.json`` (Chrome trace)."""
    if not text.lower().endswith((".png", ".json")):
        raise argparse.ArgumentTypeError(
            f"{text!r} must end in .png (Gantt chart) or .json (Chrome/Perfetto trace)"
        )
    return text


def emit(
    args: argparse.Namespace,
    as_json: dict[str, Any],
    text: str,
    written: tuple[str, str] | None = None,
) -> None:
    """Print one JSON object with ``--json``, else ``text`` and which file was written."""
    if args.json:
        print(json.dumps(as_json))
        return
    print(text)
    if written is not None:
        print(f"  {written[0]} written  {written[1]}")


def write_timeline(timeline: Timeline, path: str, title: str | None = None) -> None:
    """Write ``timeline`` as a PNG chart or a Chrome trace, chosen by the extension of ``path``."""
    if path.lower().endswith(".png"):
        timeline.plot(path, title)
    else:
        timeline.to_chrome_trace(path)


# simulate -------------------------------------------------------------------------------
def _add_simulate(commands: argparse._SubParsersAction) -> None:
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
    _add_schedule_options(parser)
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


def _add_schedule_options(parser: argparse.ArgumentParser) -> None:
    """One flag per option of the registered schedules (``--virtual``, ``--vertical-sync``...)."""
    seen: dict[str, list[str]] = {}
    options: dict[str, Option] = {}
    for name in names():
        for option in spec(name).options:
            seen.setdefault(option.name, []).append(name)
            options.setdefault(option.name, option)
    for key, option in options.items():
        flag = "--" + key.replace("_", "-")
        owners = ", ".join(seen[key])
        if isinstance(option.default, bool):
            parser.add_argument(
                flag, action="store_true", default=None, help=f"{owners}: {option.help}"
            )
        else:
            parser.add_argument(
                flag,
                type=positive_int,
                metavar="N",
                help=f"{owners}: {option.help} (default {option.default})",
            )


def schedule_options(args: argparse.Namespace) -> dict[str, int | bool]:
    """The schedule options given on the command line."""
    keys = {option.name for name in names() for option in spec(name).options}
    return {key: getattr(args, key) for key in keys if getattr(args, key, None) is not None}


def _run_simulate(args: argparse.Namespace) -> None:
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
            f"{schedule.name}, {schedule.num_ranks} ranks, {result.microbatches} micro-batches",
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
        f"{schedule.name}: {schedule.num_ranks} ranks{chunks}, "
        f"{result.microbatches} micro-batches{window}"
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
        "latency_s": "latency",
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


# train ----------------------------------------------------------------------------------
def _add_train(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "train",
        help="train a built-in model with a pipeline schedule and compare with the simulator",
        description=(
            "Train a built-in model on local worker processes (one per stage, gloo), or on the "
            "existing process group when started by torchrun. Prints loss, step time, "
            "throughput and the measured bubble beside the simulator's prediction."
        ),
    )
    parser.add_argument(
        "--model",
        required=True,
        choices=MODEL_NAMES,
        metavar="NAME",
        help=f"one of {', '.join(MODEL_NAMES)}",
    )
    parser.add_argument(
        "--stages",
        type=positive_int,
        metavar="P",
        help="pipeline ranks (default 2; under torchrun, the world size)",
    )
    parser.add_argument(
        "--schedule",
        default="1f1b",
        choices=names(),
        metavar="NAME",
        help=f"one of {', '.join(names())} (default 1f1b); pipedream splits each batch into "
        "--microbatches mini-batches with an update each, 2bw makes --rounds updates per step",
    )
    parser.add_argument(
        "--microbatches",
        type=positive_int,
        default=4,
        metavar="M",
        help="micro-batches per step (default 4)",
    )
    parser.add_argument(
        "--steps", type=positive_int, default=20, metavar="N", help="optimizer steps (default 20)"
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        metavar="B",
        help="samples per step (default: 64, gpt 16)",
    )
    parser.add_argument(
        "--balance",
        type=_balance,
        metavar="N,N,...",
        help="layers per stage, e.g. 2,3 (default: even)",
    )
    parser.add_argument(
        "--recompute",
        default="never",
        choices=RECOMPUTE_MODES,
        metavar="MODE",
        help=f"re-materialization: {', '.join(RECOMPUTE_MODES)} (default never)",
    )
    parser.add_argument(
        "--lr", type=_learning_rate, metavar="LR", help="Adam learning rate (default per model)"
    )
    _add_schedule_options(parser)
    parser.add_argument(
        "--replicas",
        type=_balance,
        metavar="N,N,...",
        help="workers per stage, e.g. 2,1 ("
        + ", ".join(name for name in names() if spec(name).replicable)
        + "; default one each)",
    )
    parser.add_argument(
        "--plan",
        metavar="auto|PLAN.json",
        help="take split, replication, schedule and micro-batches from a plan; "
        "auto profiles and plans first",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the weights and the data (default 0)"
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        metavar="N",
        help="torch threads per local worker (default 1)",
    )
    parser.add_argument(
        "--trace",
        type=output_path,
        metavar="PATH",
        help="write the last step's timeline: .png (predicted and measured) or .json Chrome trace",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _balance(text: str) -> tuple[int, ...]:
    return tuple(positive_int(part) for part in text.split(","))


def _learning_rate(text: str) -> float:
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be greater than 0")
    return value


def _run_train(args: argparse.Namespace) -> None:
    from pipetrain.app.train_job import TrainConfig, run_training

    config = TrainConfig(
        model=args.model,
        stages=args.stages,
        schedule=args.schedule,
        microbatches=args.microbatches,
        steps=args.steps,
        batch_size=args.batch_size,
        balance=args.balance,
        recompute=args.recompute,
        lr=args.lr,
        schedule_options=schedule_options(args),
        seed=args.seed,
        threads=args.threads,
        replicas=args.replicas,
        plan=_train_plan(args),
        plan_auto=args.plan == "auto",
    )
    report = run_training(config)
    if report is None:  # a torchrun rank other than 0: rank 0 reports
        return
    if args.trace:
        report.write_trace(args.trace)
    emit(args, report.to_json(), report.summary(), ("timeline", args.trace) if args.trace else None)


def _train_plan(args: argparse.Namespace) -> Plan | None:
    """The saved plan that ``--plan`` names; ``None`` without one or for ``auto``."""
    if args.plan in (None, "auto"):
        return None
    from pipetrain.planning import Plan

    return Plan.load(args.plan)


# profile --------------------------------------------------------------------------------
def _add_profile(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "profile",
        help="measure each layer of a built-in model",
        description="Measure forward and backward time, activation, parameter and optimizer "
        "bytes per layer "
        "on one micro-batch of the model's data, and save the profile as JSON.",
    )
    parser.add_argument(
        "--model",
        required=True,
        choices=MODEL_NAMES,
        metavar="NAME",
        help=f"one of {', '.join(MODEL_NAMES)}",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=64,
        metavar="B",
        help="samples per step (default 64)",
    )
    parser.add_argument(
        "--microbatches",
        type=positive_int,
        default=4,
        metavar="M",
        help="micro-batches per step: the profile is taken at B/M samples (default 4)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the weights and the data (default 0)"
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        metavar="N",
        help="torch threads while measuring (default 1)",
    )
    parser.add_argument("-o", "--out", metavar="FILE.json", help="write the profile here")
    parser.add_argument("--json", action="store_true", help="print the profile as one JSON object")


def _run_profile(args: argparse.Namespace) -> None:
    from pipetrain.app.plan_job import profile_builtin

    measured = profile_builtin(
        args.model, args.batch_size, args.microbatches, args.seed, args.threads
    )
    if args.out:
        measured.save(args.out)
    lines = [
        f"{args.model}: {len(measured.layers)} layers, micro-batch of {measured.microbatch_size}",
        f"{'layer':>5}  {'name':16} {'forward':>10} {'backward':>10} "
        f"{'activation':>11} {'parameters':>11}",
    ]
    for index, layer in enumerate(measured.layers):
        lines.append(
            f"{index:>5}  {layer.name[:16]:16} {format_seconds(layer.forward_s):>10} "
            f"{format_seconds(layer.backward_s):>10} {format_bytes(layer.activation_bytes):>11} "
            f"{format_bytes(layer.parameter_bytes):>11}"
        )
    emit(args, measured.to_dict(), "\n".join(lines), ("profile", args.out) if args.out else None)


# plan -----------------------------------------------------------------------------------
def _add_plan(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "plan",
        help="choose stages, replication, schedule and micro-batches from a profile",
        description="Plan a profiled model for a number of workers over a network: the split, "
        "the replicas of each stage, the schedule, the micro-batch count and recomputation, by "
        "simulating candidates.",
    )
    parser.add_argument(
        "--profile", required=True, metavar="FILE.json", help="a profile from pipetrain profile"
    )
    parser.add_argument(
        "--workers", type=positive_int, metavar="N", help="workers (default: all of the topology)"
    )
    parser.add_argument(
        "--topology",
        metavar="LEVELS",
        help="count x bandwidth per level, lowest first, e.g. 4x16GB/s,4x10Gbit/s "
        "(default: N workers, fast links)",
    )
    parser.add_argument(
        "--memory", metavar="SIZE", help="memory per worker, e.g. 16GiB (default: no limit)"
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        metavar="B",
        help="samples per step (default: grows with micro-batches)",
    )
    parser.add_argument(
        "--schedules",
        metavar="A,B",
        help="schedules to consider (default gpipe,1f1b,zb-h1,interleaved)",
    )
    parser.add_argument(
        "--no-replication", action="store_true", help="a straight pipeline, one worker per stage"
    )
    parser.add_argument(
        "-o", "--out", metavar="FILE.json", help="write the plan here (for train --plan)"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def _run_plan(args: argparse.Namespace) -> None:
    from pipetrain.app.plan_job import parse_bytes
    from pipetrain.planning import plan
    from pipetrain.profiler import Profile

    if args.workers is None and args.topology is None:
        raise ValueError("give --workers N or --topology LEVELS")
    options = {"schedules": tuple(args.schedules.split(","))} if args.schedules else {}
    chosen = plan(
        Profile.load(args.profile),
        workers=args.workers,
        topology=args.topology,
        memory_limit=parse_bytes(args.memory) if args.memory else None,
        batch_size=args.batch_size,
        replication=not args.no_replication,
        progress=_progress_after(PLAN_QUIET_S),
        **options,
    )
    if args.out:
        chosen.save(args.out)
    emit(args, chosen.to_dict(), chosen.describe(), ("plan", args.out) if args.out else None)


PLAN_QUIET_S = 1.0
"""Seconds a plan runs before ``pipetrain plan`` says on stderr what it is doing."""


def _progress_after(quiet_s: float) -> Callable[[str], None]:
    """Print each progress line on stderr once ``quiet_s`` seconds have passed."""
    start = time.monotonic()

    def report(line: str) -> None:
        if time.monotonic() - start >= quiet_s:
            print(line, file=sys.stderr, flush=True)

    return report


# entry point ----------------------------------------------------------------------------
COMMANDS: dict[
    str, tuple[Callable[[argparse._SubParsersAction], None], Callable[[argparse.Namespace], None]]
] = {
    "simulate": (_add_simulate, _run_simulate),
    "profile": (_add_profile, _run_profile),
    "plan": (_add_plan, _run_plan),
    "train": (_add_train, _run_train),
}


def build_parser() -> argparse.ArgumentParser:
    """The ``pipetrain`` argument parser with every command."""
    parser = _Parser(
        prog="pipetrain",
        description="Pipeline-parallel training for PyTorch: simulate and run schedules.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_arguments, _ in COMMANDS.values():
        add_arguments(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``pipetrain`` command line; return the exit status."""
    args = build_parser().parse_args(argv)
    _, run = COMMANDS[args.command]
    prog = f"pipetrain {args.command}"
    try:
        run(args)
    except (ValueError, TypeError, ScheduleError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except (RuntimeError, OSError) as error:
        print(f"{prog}: failed: {error}", file=sys.stderr)
        return RUN_FAILED
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return INTERRUPTED
    return 0
