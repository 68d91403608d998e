"""The ``pipetrain`` command line: ``simulate`` a schedule, ``profile`` and ``plan`` a model,
``train`` a built-in model.

Each command is a module with a pair of functions, ``add_<command>`` (its arguments) and
``run_<command>`` (its work and printing), listed in :data:`COMMANDS`. Errors a user can
cause print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from pipetrain.app.arguments import MODEL_NAMES, USAGE_ERROR, Parser
from pipetrain.app.cluster_command import add_cluster, run_cluster
from pipetrain.app.export_command import add_export, run_export
from pipetrain.app.plan_commands import add_plan, add_profile, run_plan, run_profile
from pipetrain.app.simulate_command import add_simulate, run_simulate
from pipetrain.app.train_command import add_train, run_train
from pipetrain.distributed.heap import keep_freed_memory
from pipetrain.schedules import ScheduleError

RUN_FAILED = 1
INTERRUPTED = 130

__all__ = ["COMMANDS", "MODEL_NAMES", "build_parser", "main"]

COMMANDS: dict[
    str, tuple[Callable[[argparse._SubParsersAction], None], Callable[[argparse.Namespace], None]]
] = {
    "simulate": (add_simulate, run_simulate),
    "profile": (add_profile, run_profile),
    "plan": (add_plan, run_plan),
    "train": (add_train, run_train),
    "cluster": (add_cluster, run_cluster),
    "export": (add_export, run_export),
}


def build_parser() -> argparse.ArgumentParser:
    """The ``pipetrain`` argument parser with every command."""
    parser = Parser(
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
    # profiles and training steps alike reuse their freed memory, so they time the same work
    keep_freed_memory()
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
