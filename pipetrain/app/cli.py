"""The ``pipetrain`` command line: ``simulate`` a schedule, ``profile`` and ``plan`` a model,
``train`` a built-in model.

Each command is a module with a pair of functions, ``add_<command>`` (its arguments) and
``run_<command>`` (its work and printing), listed in :data:`COMMANDS`. The command modules
import torch only inside ``run_<command>``, so ``--help`` and a bad argument answer at once.
Errors a user can cause print one line on stderr and exit with status 2; a run that fails
prints one line and exits with status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pickle import UnpicklingError
from typing import Any, NoReturn, cast

from pipetrain.app.arguments import MODEL_NAMES, USAGE_ERROR, Parser
from pipetrain.app.cluster_command import add_cluster, run_cluster
from pipetrain.app.export_command import add_export, run_export
from pipetrain.app.plan_commands import add_plan, add_profile, run_plan, run_profile
from pipetrain.app.simulate_command import add_simulate, run_simulate
from pipetrain.app.train_command import add_train, run_train
from pipetrain.distributed.heap import keep_freed_memory
from pipetrain.distributed.parent import AGENT_ENV, exit_now
from pipetrain.schedules import ScheduleError

RUN_FAILED = 1
INTERRUPTED = 130

LONGEST_MESSAGE = 2000
"""Characters of an error message printed; the rest is counted, not printed (a message
listing every stage of a huge plan would otherwise fill the terminal)."""

__all__ = ["COMMANDS", "MODEL_NAMES", "build_parser", "entry", "main"]

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
        _print_error(prog, "error", str(error))
        return USAGE_ERROR
    except (RuntimeError, OSError) as error:
        _print_error(prog, "failed", str(error))
        return RUN_FAILED
    except (UnpicklingError, EOFError, KeyError) as error:  # a damaged or foreign file
        _print_error(prog, "failed", f"{type(error).__name__}: {error}")
        return RUN_FAILED
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BaseException as error:
        failures = _checkpoint_failures(error)
        if failures is None:
            raise
        _print_error(prog, "failed", failures)
        return RUN_FAILED
    return 0


def entry() -> NoReturn:
    """The ``pipetrain`` executable and ``python -m pipetrain``: exit with :func:`main`'s
    status; a worker that torchrun started ends through
    :func:`~pipetrain.distributed.parent.exit_now`, so that a finished run's gloo threads
    cannot abort it while the interpreter finalizes."""
    status = main()
    if AGENT_ENV in os.environ:
        exit_now(status)
    raise SystemExit(status)


def _print_error(prog: str, verdict: str, message: str) -> None:
    """``prog: verdict: message`` on stderr, a message too long cut at :data:`LONGEST_MESSAGE`."""
    if len(message) > LONGEST_MESSAGE:
        rest = len(message) - LONGEST_MESSAGE
        message = f"{message[:LONGEST_MESSAGE]} ... ({rest:,} characters more)"
    print(f"{prog}: {verdict}: {message}", file=sys.stderr)


def _checkpoint_failures(error: BaseException) -> str | None:
    """What each rank's failure inside ``torch.distributed.checkpoint`` was, on one line
    (its ``CheckpointException`` derives from ``BaseException``); ``None`` for any other
    error."""
    checkpoint_api = sys.modules.get("torch.distributed.checkpoint.api")
    if checkpoint_api is None or not isinstance(error, checkpoint_api.CheckpointException):
        return None
    failures: dict[int, tuple[BaseException, object]] = cast(Any, error).failures
    return "; ".join(
        f"checkpoint failed on rank {rank}: {type(cause).__name__}: {cause}"
        for rank, (cause, _) in sorted(failures.items())
    )
