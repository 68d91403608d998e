"""Input whose cost follows its length, not its numbers: schedule text naming huge stage or
micro-batch numbers, schedules of more ranks × micro-batches than can be built, profiles of
more layers than can be planned or of costs beyond any measurement, and a plan of 10^5
stages are refused at once with one short line (exit 2 from the command line)."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

import pytest

from pipetrain.app import cli
from pipetrain.planning import Plan, PlanStage, plan
from pipetrain.planning.planner import MAX_LAYERS
from pipetrain.profiler import LayerCost, Profile
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


def test_a_profile_cost_beyond_any_measurement_is_refused_naming_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    layers = [LayerCost(forward_s=1e-3, backward_s=2e-3) for _ in range(4)]
    with pytest.raises(ValueError, match=r"Profile.message_s = 1e\+308 exceeds 1e\+06 seconds"):
        Profile(layers, message_s=1e308)
    with pytest.raises(ValueError, match=r"layer 2: forward_s = 1e\+300 exceeds"):
        Profile([*layers[:2], LayerCost(forward_s=1e300, backward_s=2e300), layers[3]])
    written = tmp_path / "profile.json"
    data = Profile(layers).to_dict()
    data["message_s"] = 1e308
    written.write_text(json.dumps(data))
    assert cli.main(["plan", "--profile", str(written), "--workers", "2"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "message_s" in err and str(written) in err


def test_a_profile_of_too_many_layers_is_refused_before_planning() -> None:
    layers = [LayerCost(forward_s=1e-3, backward_s=2e-3)] * (MAX_LAYERS + 1)
    with pytest.raises(ValueError, match=f"the profile has {MAX_LAYERS + 1:,} layers"):
        plan(Profile(layers), workers=4)
    assert peak_bytes(lambda: plan(Profile(layers), workers=4)) < 10_000_000


def test_a_plan_of_100000_stages_is_refused_in_one_short_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    stages = 100_000
    written = tmp_path / "plan.json"
    Plan(
        stages=[PlanStage(i, i + 1) for i in range(stages)],
        schedule="1f1b",
        microbatches=4,
        recompute="never",
        predicted_step_s=1.0,
        predicted_throughput=1.0,
        stage_memory_bytes=[1.0] * stages,
        ranks=stages,
        microbatch_size=8,
    ).save(written)
    status = cli.main(["train", "--model", "mlp", "--plan", str(written)])
    err = capsys.readouterr().err
    assert status == 2, err[:300]
    assert len(err.strip().splitlines()) == 1 and len(err) < 300, err[:300]
    assert "99,992 more" in err and "samples/s" not in err
