"""Input whose cost follows its length, not its numbers: schedule text naming huge stage or
micro-batch numbers, and schedules of more ranks × micro-batches than can be built, are
refused at once with one line (exit 2 from the command line)."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

import pytest

from pipetrain.app import cli
from pipetrain.schedules import MAX_RANK_MICROBATCHES, Schedule, ScheduleError, build

# each would size a table by its number: 10^7 micro-batches, 10^8 stages
HUGE_TEXTS = [
    "rank 0: F0.0 B0.0 F9999999.0 STEP0",
    "rank 0: F0.0 B0.0 F0.99999999 STEP0",
    "schedule x: 100000000 stages on 1 ranks, 1 micro-batches\nrank 0: F0.0 B0.0 STEP0",
]


def peak_bytes(work: Callable[[], object]) -> int:
    """The most memory Python allocated while ``work()`` ran (and was refused)."""
    tracemalloc.start()
    with suppress(ScheduleError, ValueError):
        work()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


@pytest.mark.parametrize("text", HUGE_TEXTS)
def test_schedule_text_costs_what_its_length_does(text: str) -> None:
    with pytest.raises(ScheduleError, match="forwards") as error:
        Schedule.from_text(text)
    assert "\n" not in str(error.value) and len(str(error.value)) < 300
    # a 10^7-entry table would take hundreds of megabytes; the text is tens of bytes
    assert peak_bytes(lambda: Schedule.from_text(text)) < 1_000_000


def test_a_written_schedule_still_reads() -> None:
    text = "rank 0: F0.0 B0.0 STEP0\nrank 1: F1.0 B1.0 STEP1"
    assert Schedule.from_text(text).microbatches == 1


def test_a_schedule_too_large_to_build_is_refused_at_once() -> None:
    with pytest.raises(ValueError, match="100000 ranks playing 100000 micro-batches"):
        build("1f1b", 100_000, 100_000)
    assert peak_bytes(lambda: build("1f1b", 100_000, 100_000)) < 1_000_000
    assert build("1f1b", 4, MAX_RANK_MICROBATCHES // 4 // 64).microbatches == 3906


def test_simulate_refuses_a_schedule_too_large_with_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = cli.main(
        ["simulate", "--schedule", "1f1b", "--ranks", "100000", "--microbatches", "100000"]
    )
    err = capsys.readouterr().err
    assert status == 2, err
    assert len(err.strip().splitlines()) == 1 and "give fewer ranks or micro-batches" in err


def test_simulate_refuses_huge_schedule_text_with_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    written = tmp_path / "huge.txt"
    written.write_text(HUGE_TEXTS[0])
    status = cli.main(["simulate", "--schedule-file", str(written)])
    err = capsys.readouterr().err
    assert status == 2, err
    assert len(err.strip().splitlines()) == 1 and "forwards" in err
