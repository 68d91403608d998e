"""``pipetrain profile`` and ``pipetrain plan``: their arguments, and the profile or plan
printed as a table or JSON."""

from __future__ import annotations

import argparse
import sys

from pipetrain.app.arguments import add_model_argument, emit, positive_int, progress_printer
from pipetrain.schedules import names, spec
from pipetrain.units import counted, format_bytes, format_seconds, parse_bandwidth, parse_bytes


def add_profile(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "profile",
        help="measure each layer of a built-in model",
        description="Measure forward and backward time, activation, parameter and optimizer "
        "bytes per layer "
        "on one micro-batch of the model's data, and save the profile as JSON.",
    )
    add_model_argument(parser)
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


def run_profile(args: argparse.Namespace) -> None:
    from pipetrain.app.plan_job import PROFILE_REPEATS, profile_builtin

    if args.batch_size >= args.microbatches:  # profile_builtin refuses the others
        print(
            f"profiling {args.model} at micro-batches of {args.batch_size // args.microbatches} "
            f"samples: each layer timed {PROFILE_REPEATS} times ...",
            file=sys.stderr,
            flush=True,
        )
    measured = profile_builtin(
        args.model, args.batch_size, args.microbatches, args.seed, args.threads
    )
    if args.out:
        measured.save(args.out)
    lines = [
        f"{args.model}: {counted(len(measured.layers), 'layer')}, micro-batch of "
        f"{counted(measured.microbatch_size, 'sample')}",
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


def add_plan(commands: argparse._SubParsersAction) -> None:
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
        "--ranks",
        dest="workers",
        type=positive_int,
        metavar="N",
        help="worker processes to plan for, as train --ranks counts them (default: all of "
        "the topology)",
    )
    # its former name, still read: the plan's workers are the ranks train starts
    parser.add_argument("--workers", dest="workers", type=positive_int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--topology",
        metavar="LEVELS",
        help="count x bandwidth per level, lowest first, e.g. 4x16GB/s,4x10Gbit/s "
        "(default: N workers, fast links)",
    )
    parser.add_argument(
        "--worker-memory",
        dest="memory",
        metavar="SIZE",
        help="memory per worker, e.g. 16GiB (default: no limit); roundpipe's workers need "
        "only their working set",
    )
    # its former name, still read
    parser.add_argument("--memory", dest="memory", help=argparse.SUPPRESS)
    parser.add_argument(
        "--host-memory",
        metavar="SIZE",
        help="memory of the host store that roundpipe keeps the whole model in (weights, "
        "gradients, optimizer state), e.g. 64GiB (default: no limit)",
    )
    parser.add_argument(
        "--host-bandwidth",
        metavar="RATE",
        help="each worker's link to roundpipe's host store, e.g. 25GB/s for a GPU's PCIe 4.0 "
        "x16 (default 10GB/s, a CPU's memcpy from shared memory)",
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
        help=f"schedules to consider, of {', '.join(names())} (default "
        f"{','.join(name for name in names() if spec(name).planned_by_default)})",
    )
    parser.add_argument(
        "--no-replication", action="store_true", help="a straight pipeline, one worker per stage"
    )
    parser.add_argument(
        "--no-shard",
        action="store_true",
        help="replicated stages as whole copies only (by default shards are tried too)",
    )
    parser.add_argument(
        "-o", "--out", metavar="FILE.json", help="write the plan here (for train --plan)"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def run_plan(args: argparse.Namespace) -> None:
    from pipetrain.planning import plan
    from pipetrain.planning.host_store import DEFAULT_HOST_BANDWIDTH
    from pipetrain.profiler import Profile

    if args.workers is None and args.topology is None:
        raise ValueError("give --ranks N or --topology LEVELS")
    chosen = plan(
        Profile.load(args.profile),
        workers=args.workers,
        topology=args.topology,
        memory_limit=parse_bytes(args.memory) if args.memory else None,
        host_memory_limit=parse_bytes(args.host_memory) if args.host_memory else None,
        host_bandwidth=parse_bandwidth(args.host_bandwidth)
        if args.host_bandwidth
        else DEFAULT_HOST_BANDWIDTH,
        batch_size=args.batch_size,
        replication=not args.no_replication,
        shard=not args.no_shard,
        progress=progress_printer(quiet_s=1.0),
        schedules=tuple(args.schedules.split(",")) if args.schedules else None,
    )
    if args.out:
        chosen.save(args.out)
    emit(args, chosen.to_dict(), chosen.describe(), ("plan", args.out) if args.out else None)
