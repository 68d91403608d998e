"""What the ``pipetrain`` commands share: the parser whose errors are one line, argument
types, the schedule options as flags, and printing text or JSON."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from pipetrain.app.model_registry import MODEL_NAMES
from pipetrain.schedules import Option, names, spec
from pipetrain.timeline import Timeline

USAGE_ERROR = 2
"""Exit status of a bad argument."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr, without the usage block."""

    def error(self, message: str) -> NoReturn:
        """Print ``message`` on one line and exit with status 2."""
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """``--model NAME``, one of the built-in models (required)."""
    parser.add_argument(
        "--model",
        required=True,
        choices=MODEL_NAMES,
        metavar="NAME",
        help=f"one of {', '.join(MODEL_NAMES)}",
    )


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


def add_schedule_options(parser: argparse.ArgumentParser) -> None:
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


def say(line: str) -> None:
    """A phase's progress line on stderr, in the step lines' style (``starting 2 ranks ...``),
    so that no phase longer than a second or two passes in silence."""
    print(line, file=sys.stderr, flush=True)


def progress_printer(quiet_s: float = 0.0, every_s: float = 1.0) -> Callable[[str], None]:
    """A ``progress`` callback that prints lines on stderr once ``quiet_s`` seconds have
    passed, at most one every ``every_s`` seconds (a line arriving sooner is dropped: a
    later one says more), never the same line twice in a row."""
    last_line, last_at = "", time.monotonic() - every_s + quiet_s

    def report(line: str) -> None:
        nonlocal last_line, last_at
        now = time.monotonic()
        if now - last_at >= every_s and line != last_line:
            print(line, file=sys.stderr, flush=True)
            last_line, last_at = line, now

    return report


@contextlib.contextmanager
def ticking(label: str | Callable[[], str | None], every_s: float = 4.0) -> Iterator[None]:
    """While the block runs, say ``label: N s ...`` every ``every_s`` seconds, so that a long
    phase does not look like a hang. A callable ``label`` is asked at every tick: ``None``
    keeps quiet then (another process is talking)."""
    done = threading.Event()
    start = time.monotonic()

    def tick() -> None:
        while not done.wait(every_s):
            now = label() if callable(label) else label
            if now is not None:
                say(f"{now}: {time.monotonic() - start:.0f} s ...")

    thread = threading.Thread(target=tick, name="pipetrain-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def check_saving(
    save_dir: str | None, save_every: int | None, accumulate: int, keep_checkpoints: int
) -> None:
    """Raise a ValueError, naming the flags, for save settings of ``pipetrain train`` that
    cannot work (checked before torch loads, and again by the run's configuration)."""
    if save_every is not None and save_dir is None:
        raise ValueError("--save-every needs --save-dir DIR, the directory to save into")
    if save_every is not None and (save_every < 1 or save_every % accumulate):
        raise ValueError(
            f"--save-every {save_every} must be a positive multiple of --accumulate "
            f"{accumulate}: a checkpoint is taken after an update"
        )
    if keep_checkpoints < 1:
        raise ValueError(f"--keep-checkpoints must be at least 1, got {keep_checkpoints}")
