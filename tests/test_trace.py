"""Tests for pipetrain.timeline: timeline figures, serialisation and exports."""

from __future__ import annotations

import enum
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.timeline import BUSY_KINDS, Event, Timeline, gantt, plot_timelines

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def gpipe_events(
    ranks: int, microbatches: int, forward: float = 1.0, backward: float = 2.0
) -> list[Event]:
    """A GPipe-shaped timeline in closed form: all forwards, then all backwards."""
    events = []
    backward_start = (microbatches + ranks - 1) * forward
    for rank in range(ranks):
        for mb in range(microbatches):
            f_start = (rank + mb) * forward
            events.append(Event(rank, "F", rank, mb, f_start, f_start + forward))
            b_start = backward_start + (ranks - 1 - rank + mb) * backward
            events.append(Event(rank, "B", rank, mb, b_start, b_start + backward))
    return events


def two_stage_gpipe() -> Timeline:
    """2 ranks, 2 micro-batches, forward 1 s, backward 2 s, written out by hand."""
    events = [
        Event(0, "F", 0, 0, 0.0, 1.0),
        Event(0, "F", 0, 1, 1.0, 2.0),
        Event(1, "F", 1, 0, 1.0, 2.0),
        Event(1, "F", 1, 1, 2.0, 3.0),
        Event(1, "B", 1, 0, 3.0, 5.0),
        Event(1, "B", 1, 1, 5.0, 7.0),
        Event(0, "B", 0, 0, 5.0, 7.0),
        Event(0, "B", 0, 1, 7.0, 9.0),
        Event(0, "SEND_F", 0, 0, 1.0, 1.5),  # communication is not busy time
        Event(1, "RECV_F", 1, 0, 0.5, 1.0),
    ]
    return Timeline(events, num_ranks=2, label="gpipe 2x2")


def test_hand_computed_figures() -> None:
    timeline = two_stage_gpipe()
    assert timeline.makespan == 9.0
    assert timeline.busy_time(0) == 6.0
    assert timeline.busy_time(1) == 6.0
    # (p - 1) / (m + p - 1) = 1/3 for p = m = 2 when backward = 2 x forward
    assert timeline.bubble_fraction == pytest.approx(1 / 3)
    assert timeline.peak_activations == [2, 2]


def test_makespan_uses_earliest_start_not_zero() -> None:
    timeline = Timeline([Event(0, "F", 0, 0, 10.0, 11.0), Event(1, "F", 1, 0, 11.0, 13.0)], 2)
    assert timeline.makespan == 3.0
    assert timeline.bubble_fraction == pytest.approx(1 - 3.0 / (2 * 3.0))


def test_step_and_weight_count_as_busy_but_wait_does_not() -> None:
    assert {"F", "B", "W", "STEP"} == BUSY_KINDS
    events = [
        Event(0, "W", 0, 0, 0.0, 1.0),
        Event(0, "STEP", 0, None, 1.0, 2.0),
        Event(0, "WAIT", None, None, 2.0, 4.0),
        Event(0, "ALLREDUCE", 0, None, 4.0, 5.0),
    ]
    timeline = Timeline(events, 1)
    assert timeline.busy_time(0) == 2.0
    assert timeline.bubble_fraction == pytest.approx(1 - 2.0 / 5.0)


def test_empty_timeline() -> None:
    timeline = Timeline([], 3)
    assert timeline.makespan == 0.0
    assert timeline.bubble_fraction == 0.0
    assert timeline.peak_activations == [0, 0, 0]
    assert timeline.shifted() == timeline


def test_release_before_acquire_at_equal_times() -> None:
    touching = [
        Event(0, "F", 0, 0, 0.0, 1.0),
        Event(0, "B", 0, 0, 1.0, 2.0),
        Event(0, "F", 0, 1, 2.0, 3.0),  # starts exactly when B0 ends: B0's slot is freed first
        Event(0, "B", 0, 1, 3.0, 4.0),
    ]
    assert Timeline(touching, 1).peak_activations == [1]
    overlapping = [*touching[:2], Event(0, "F", 0, 1, 1.9, 3.0), touching[3]]
    assert Timeline(overlapping, 1).peak_activations == [2]


def test_peak_counts_stage_microbatch_pairs_on_interleaved_rank() -> None:
    # Rank 0 holds stages 0 and 2: micro-batch 0 of both stages is two activations.
    events = [
        Event(0, "F", 0, 0, 0.0, 1.0),
        Event(1, "F", 1, 0, 1.0, 2.0),
        Event(0, "F", 2, 0, 2.0, 3.0),
        Event(0, "F", 0, 1, 3.0, 4.0),
        Event(0, "B", 2, 0, 4.0, 5.0),
        Event(1, "B", 1, 0, 5.0, 6.0),
        Event(0, "B", 0, 0, 6.0, 7.0),
        Event(0, "F", 2, 1, 7.0, 8.0),  # (0,0) and (2,0) released; (0,1) and (2,1) held
    ]
    assert Timeline(events, 2).peak_activations == [3, 1]


def test_forward_without_backward_stays_held() -> None:
    events = [Event(0, "F", 0, mb, float(mb), mb + 1.0) for mb in range(5)]
    assert Timeline(events, 1).peak_activations == [5]


@st.composite
def forward_backward_pairs(draw: st.DrawFn) -> tuple[list[Event], int]:
    """Random F/B pairs on two ranks with integer times (so ties are frequent)."""
    events = []
    for rank in range(2):
        for key in range(draw(st.integers(0, 6))):
            stage, mb = divmod(key, 3)
            f_start = draw(st.integers(0, 8))
            f_end = f_start + draw(st.integers(0, 3))
            b_start = f_end + draw(st.integers(0, 3))
            b_end = b_start + draw(st.integers(1, 3))
            events.append(Event(rank, "F", stage, mb, f_start, f_end))
            events.append(Event(rank, "B", stage, mb, b_start, b_end))
    return events, 2


def brute_force_peak(events: list[Event], rank: int) -> int:
    """At every forward start t, count pairs with F.start <= t < B.end on ``rank``."""
    mine = [e for e in events if e.rank == rank]
    forwards = {(e.stage, e.microbatch): e.start for e in mine if e.kind == "F"}
    backwards = {(e.stage, e.microbatch): e.end for e in mine if e.kind == "B"}
    held_at = [
        sum(1 for key, start in forwards.items() if start <= t < backwards[key])
        for t in forwards.values()
    ]
    return max(held_at, default=0)


@settings(max_examples=100, deadline=None)
@given(forward_backward_pairs())
def test_peak_matches_brute_force(case: tuple[list[Event], int]) -> None:
    events, ranks = case
    expected = [brute_force_peak(events, rank) for rank in range(ranks)]
    assert Timeline(events, ranks).peak_activations == expected


def test_events_sorted_by_start_then_rank_and_split_by_rank() -> None:
    a = Event(1, "F", 1, 0, 1.0, 2.0)
    b = Event(0, "F", 0, 1, 1.0, 2.0)
    c = Event(0, "F", 0, 0, 0.0, 1.0)
    timeline = Timeline([a, b, c], 2)
    assert timeline.events == (c, b, a)
    assert timeline.rank_events(0) == [c, b]
    assert timeline.rank_events(1) == [a]


def test_shifted_moves_origin_to_zero() -> None:
    events = [Event(0, "F", 0, 0, 100.5, 101.0), Event(1, "B", 1, 0, 101.0, 103.0)]
    timeline = Timeline(events, 2, "x")
    moved = timeline.shifted()
    assert [(e.start, e.end) for e in moved.events] == [(0.0, 0.5), (0.5, 2.5)]
    assert moved.makespan == timeline.makespan
    assert moved.label == "x"
    assert timeline.events[0].start == 100.5


class _StrKind(str, enum.Enum):
    FORWARD = "F"


def test_str_enum_kind_becomes_plain_string() -> None:
    event = Event(0, _StrKind.FORWARD, 0, 0, 0.0, 1.0)
    assert type(event.kind) is str and event.kind == "F"
    assert event.name == "F0.0"


def test_dict_round_trip_through_json() -> None:
    timeline = two_stage_gpipe()
    data = json.loads(json.dumps(timeline.to_dict()))
    assert data["format_version"] == 1
    restored = Timeline.from_dict(data)
    assert restored == timeline
    assert restored.label == "gpipe 2x2" and restored.num_ranks == 2


def test_save_load_round_trip(tmp_path: Path) -> None:
    timeline = Timeline(
        [Event(0, "F", 0, 0, 0.1, 0.30000000000000004), Event(0, "STEP", 0, None, 0.5, 0.7)], 1, "s"
    )
    path = tmp_path / "timeline.json"
    timeline.save(path)
    assert "format_version" in json.loads(path.read_text())
    assert Timeline.load(path) == timeline


def test_from_dict_rejects_unknown_version_and_missing_fields() -> None:
    data = two_stage_gpipe().to_dict()
    with pytest.raises(ValueError, match="format_version 99"):
        Timeline.from_dict({**data, "format_version": 99})
    with pytest.raises(ValueError, match="num_ranks"):
        Timeline.from_dict({"events": []})
    with pytest.raises(ValueError, match="end"):
        no_end = {"rank": 0, "kind": "F", "stage": 0, "microbatch": 0, "start": 0}
        Timeline.from_dict({**data, "events": [no_end]})


def test_chrome_trace(tmp_path: Path) -> None:
    timeline = Timeline(
        [
            Event(0, "F", 3, 5, 0.25, 0.2505),
            Event(1, "STEP", 1, None, 1.0, 1.002),
            Event(2, "WAIT", None, None, 0.5, 0.75),
        ],
        num_ranks=4,
    )
    path = tmp_path / "trace.json"
    timeline.to_chrome_trace(path)
    trace = json.loads(path.read_text())
    assert trace["displayTimeUnit"] == "ms"
    names = [e for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert len(names) == 4
    threads = {e["tid"]: e["args"]["name"] for e in names}
    assert threads == {rank: f"rank {rank}" for rank in range(4)}
    complete = sorted((e for e in trace["traceEvents"] if e["ph"] == "X"), key=lambda e: e["ts"])
    assert [(e["name"], e["cat"], e["tid"], e["pid"]) for e in complete] == [
        ("F3.5", "F", 0, 0),
        ("WAIT", "WAIT", 2, 0),
        ("STEP1", "STEP", 1, 0),
    ]
    assert [e["ts"] for e in complete] == pytest.approx([250_000.0, 500_000.0, 1_000_000.0])
    assert [e["dur"] for e in complete] == pytest.approx([500.0, 250_000.0, 2_000.0])
    assert complete[0]["args"] == {"stage": 3, "microbatch": 5}


def test_summary_mentions_the_figures() -> None:
    text = two_stage_gpipe().summary()
    assert "gpipe 2x2" in text
    assert "9 s" in text
    assert "33.3%" in text
    assert "[2, 2]" in text


def test_plot_small(tmp_path: Path) -> None:
    path = tmp_path / "small.png"
    two_stage_gpipe().plot(path, title="two stages")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_plot_empty_timeline(tmp_path: Path) -> None:
    path = tmp_path / "empty.png"
    Timeline([], 2).plot(path)
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_plot_large(tmp_path: Path) -> None:
    events = gpipe_events(64, 512, forward=1e-3, backward=2e-3)
    events += [
        Event(e.rank, "RECV_F", e.stage, e.microbatch, e.start - 1e-4, e.start)
        for e in events[:4000:2]
    ]
    path = tmp_path / "large.png"
    Timeline(events, 64, "gpipe 64x512").plot(path)
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_plot_timelines_side_by_side(tmp_path: Path) -> None:
    predicted = Timeline(gpipe_events(4, 8), 4, "predicted")
    measured = Timeline(gpipe_events(4, 8, forward=1.1, backward=2.3), 4, "measured")
    chunks = [
        Event(0, "F", 0, 0, 0.0, 1.0),
        Event(1, "F", 1, 0, 1.0, 2.0),
        Event(0, "F", 2, 0, 2.0, 3.0),
    ]
    interleaved = Timeline(chunks, 2)
    path = tmp_path / "pair.png"
    plot_timelines([predicted, measured, interleaved], path, ["a", "b", "c"])
    assert path.read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ValueError, match="2 titles for 3 timelines"):
        plot_timelines([predicted, measured, interleaved], path, ["a", "b"])
    with pytest.raises(ValueError, match="at least one timeline"):
        plot_timelines([], path)


def test_target_output_and_loss_kinds_plot_and_export(tmp_path: Path) -> None:
    new_kinds = ["SEND_T", "RECV_T", "SEND_O", "RECV_O", "LOSS"]
    events = [
        Event(0, "F", 0, 0, 0.0, 1.0),
        Event(0, "SEND_T", 0, 0, 0.0, 0.1),
        Event(1, "RECV_T", 1, 0, 0.0, 0.1),
        Event(1, "F", 1, 0, 1.0, 2.0),
        Event(1, "SEND_O", 1, 0, 2.0, 2.2),
        Event(0, "RECV_O", 0, 0, 2.0, 2.2),
        Event(0, "LOSS", None, None, 2.2, 2.5),
        Event(1, "LOSS", None, None, 2.2, 2.5),
    ]
    timeline = Timeline(events, 2, "targets, outputs and loss")
    assert timeline.busy_time(0) == timeline.busy_time(1) == 1.0
    assert timeline.bubble_fraction == pytest.approx(1 - 2.0 / (2 * 2.5))
    # every new kind draws in the communication strip; LOSS with the all-reduce style
    assert [gantt._comm_key(kind) for kind in new_kinds] == [
        "SEND",
        "RECV",
        "SEND",
        "RECV",
        "ALLREDUCE",
    ]
    png = tmp_path / "kinds.png"
    timeline.plot(png)
    assert png.read_bytes()[:8] == PNG_MAGIC
    trace_path = tmp_path / "kinds.json"
    timeline.to_chrome_trace(trace_path)
    trace = json.loads(trace_path.read_text())
    categories = {e["cat"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert categories == {"F", *new_kinds}


def test_event_ending_before_start_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"Event\(rank=0, kind='B'.*ends before it starts"):
        Event(0, "B", 1, 2, 5.0, 4.0)
    with pytest.raises(ValueError, match="non-finite"):
        Event(0, "F", 0, 0, float("nan"), 1.0)
    with pytest.raises(TypeError, match="rank"):
        Event("zero", "F", 0, 0, 0.0, 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="start='0'"):
        Event(0, "F", 0, 0, "0", 1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("rank", [-1, 2])
def test_rank_out_of_range_is_rejected(rank: int) -> None:
    with pytest.raises(ValueError, match=rf"Event\(rank={rank}, kind='F'.*outside \[0, 2\)"):
        Timeline([Event(rank, "F", 0, 0, 0.0, 1.0)], num_ranks=2)


def test_bad_num_ranks_and_rank_queries_are_rejected() -> None:
    with pytest.raises(ValueError, match="num_ranks"):
        Timeline([], 0)
    with pytest.raises(ValueError, match="rank 5"):
        two_stage_gpipe().rank_events(5)


def test_import_does_not_load_matplotlib() -> None:
    repo = str(Path(__file__).resolve().parents[1])
    code = (
        f"import sys; sys.path.insert(0, {repo!r}); import pipetrain.timeline; "
        "print('matplotlib' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
