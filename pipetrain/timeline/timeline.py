"""Timelines: what every rank did and when, and their exports.

A :class:`Timeline` is a set of timed :class:`Event` values, one per action a rank performed.
The simulator fills one with predicted times and the runtime with measured ones; this module
knows nothing about where the events came from. It computes the figures a pipeline schedule is
judged by (makespan, bubble fraction, peak in-flight activations) and exports the timeline as
JSON, as a Chrome/Perfetto trace, and as a PNG Gantt chart (drawn by
:mod:`pipetrain.timeline.gantt`).
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
from collections.abc import Callable, Iterable, Sequence
from functools import cached_property
from os import PathLike
from typing import Any, NamedTuple

from pipetrain.checks import positive_int
from pipetrain.jsonfile import JsonFile, unversioned, versioned, write_json
from pipetrain.units import format_seconds

FORMAT_VERSION = 1
"""Version of the JSON layout written by :meth:`Timeline.to_dict` and :meth:`Timeline.save`."""

BUSY_KINDS = frozenset({"F", "B", "W", "STEP"})
"""Event kinds that count as useful work when computing busy time and the bubble fraction:
compute and the optimizer step. An overlapped pair's passes are ``F`` and ``B`` events (its
``OVERLAP`` marker has no length); sends, receives and collectives are not work."""

_EVENT_FIELDS = ("rank", "kind", "stage", "microbatch", "start", "end")
_START_RANK = operator.itemgetter(4, 0)  # an event's (start, rank), the timeline's order
_RANK, _START, _END = operator.itemgetter(0), operator.itemgetter(4), operator.itemgetter(5)

StrPath = str | PathLike[str]


class _EventFields(NamedTuple):
    rank: int
    kind: str
    stage: int | None
    microbatch: int | None
    start: float
    end: float


class Event(_EventFields):
    """One timed action of one rank (an immutable tuple of the six fields).

    ``kind`` is ``"F"``, ``"B"``, ``"W"``, ``"STEP"``, a communication kind (``"SEND_F"``,
    ``"RECV_F"``, ``"SEND_B"``, ``"RECV_B"``, targets ``"SEND_T"``/``"RECV_T"``, eval outputs
    ``"SEND_O"``/``"RECV_O"``, ``"ALLREDUCE"``, a sharded stage's ``"GATHER"``, a stage's
    weights from the host store ``"LOAD"`` and its gradients back ``"OFFLOAD"``, the loss
    all-reduce ``"LOSS"``, ``"WAIT"``) or any other string. ``stage`` and ``microbatch`` are
    ``None`` when the action has none (an optimizer step has no micro-batch). ``start`` and
    ``end`` are in seconds, from any fixed origin.
    """

    __slots__ = ()

    def __new__(
        cls,
        rank: int,
        kind: str,
        stage: int | None,
        microbatch: int | None,
        start: float,
        end: float,
    ) -> Event:
        """Normalise the field types and reject impossible times."""
        if (
            type(kind) is str
            and type(rank) is int
            and (stage is None or type(stage) is int)
            and (microbatch is None or type(microbatch) is int)
            and type(start) is float
            and type(end) is float
            and -math.inf < start <= end < math.inf
        ):
            return tuple.__new__(cls, (rank, kind, stage, microbatch, start, end))
        what = (
            f"event Event(rank={rank!r}, kind={kind!r}, stage={stage!r}, "
            f"microbatch={microbatch!r}, start={start!r}, end={end!r})"
        )
        if not isinstance(kind, str):
            raise TypeError(f"Event kind must be a string such as 'F', got {kind!r}")
        values = (
            _as_int(rank, "rank", what),
            str.__str__(kind),  # a str-valued enum (the schedule's Kind) becomes its value
            _as_optional_int(stage, "stage", what),
            _as_optional_int(microbatch, "microbatch", what),
            _as_seconds(start, "start", what),
            _as_seconds(end, "end", what),
        )
        if not (math.isfinite(values[4]) and math.isfinite(values[5])):
            raise ValueError(f"{what} has a non-finite time; give finite seconds")
        if values[5] < values[4]:
            raise ValueError(f"{what} ends before it starts; swap start and end")
        return tuple.__new__(cls, values)

    @property
    def duration(self) -> float:
        """``end - start`` in seconds."""
        return self.end - self.start

    @property
    def name(self) -> str:
        """A short name such as ``"F3.5"`` (kind, stage, micro-batch)."""
        text = self.kind
        if self.stage is not None:
            text += str(self.stage)
        if self.microbatch is not None:
            text += f".{self.microbatch}"
        return text


trusted_event: Callable[[tuple[int, str, int | None, int | None, float, float]], Event] = (
    functools.partial(tuple.__new__, Event)
)
"""An :class:`Event` from a ``(rank, kind, stage, microbatch, start, end)`` tuple whose values
are known to be of the right types and order, unchecked: how the simulator and the runtime's
recorder make events by the hundred thousand (the call runs in C)."""


def _as_int(value: Any, field_name: str, event: str) -> int:
    """``value`` as an ``int``, or a TypeError naming the event."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{event} has {field_name}={value!r}; {field_name} must be an integer"
        ) from None


def _as_seconds(value: Any, field_name: str, event: str) -> float:
    """``value`` as a ``float``, or a TypeError naming the event."""
    if not isinstance(value, numbers.Real):
        raise TypeError(f"{event} has {field_name}={value!r}; give a time in seconds")
    return float(value)


def _as_optional_int(value: Any, field_name: str, event: str) -> int | None:
    """``value`` as an ``int``, keeping ``None``."""
    return None if value is None else _as_int(value, field_name, event)


class Timeline(JsonFile):
    """The events of one run (predicted or measured) over ``num_ranks`` ranks.

    ``events`` is sorted by ``(start, rank)``. A timeline is immutable: methods that change
    times return a new one.
    """

    def __init__(self, events: Iterable[Event], num_ranks: int, label: str = "") -> None:
        """Collect ``events`` and check that every one belongs to a rank in range."""
        positive_int("num_ranks", num_ranks)
        if not isinstance(label, str):
            raise TypeError(f"label must be a string, got {label!r}")
        collected = tuple(events)
        # map and set run in C: the simulator hands over hundreds of thousands of events
        if not set(map(type, collected)) <= {Event}:
            for event in collected:
                if not isinstance(event, Event):
                    raise TypeError(f"timeline events must be Event values, got {event!r}")
        ranks = set(map(_RANK, collected))
        if ranks and not (min(ranks) >= 0 and max(ranks) < num_ranks):
            event = next(e for e in collected if not 0 <= e.rank < num_ranks)
            raise ValueError(
                f"event {event!r} has rank {event.rank} outside [0, {num_ranks}); "
                f"pass num_ranks > {event.rank} or fix the event's rank"
            )
        # in any order; `events` sorts them when first asked
        self._collected: Sequence[Event] = collected
        self.num_ranks: int = num_ranks
        self.label: str = label

    @classmethod
    def trusted(cls, events: Iterable[Event], num_ranks: int, label: str) -> Timeline:
        """A timeline of ``events`` known to be :class:`Event` values of ranks in
        ``range(num_ranks)``, unchecked: the simulator makes them so, by the hundred
        thousand, and checking them was a tenth of a simulation. A list is kept as it is,
        not copied: the caller hands it over and changes it no more."""
        timeline = cls.__new__(cls)
        timeline._collected = events if isinstance(events, list) else tuple(events)
        timeline.num_ranks = num_ranks
        timeline.label = label
        return timeline

    def __repr__(self) -> str:
        """A one-line description (not the events)."""
        return (
            f"Timeline(label={self.label!r}, num_ranks={self.num_ranks}, "
            f"events={len(self._collected)}, makespan={self.makespan:.6g})"
        )

    def __eq__(self, other: object) -> bool:
        """Timelines are equal when their events, rank count and label are."""
        if not isinstance(other, Timeline):
            return NotImplemented
        return (self.events, self.num_ranks, self.label) == (
            other.events,
            other.num_ranks,
            other.label,
        )

    @cached_property
    def events(self) -> tuple[Event, ...]:
        """Every event, sorted by ``(start, rank)``."""
        return tuple(sorted(self._collected, key=_START_RANK))

    @cached_property
    def _by_rank(self) -> tuple[tuple[Event, ...], ...]:
        """Each rank's events in timeline order."""
        lanes: list[list[Event]] = [[] for _ in range(self.num_ranks)]
        for event in self.events:
            lanes[event.rank].append(event)
        return tuple(tuple(lane) for lane in lanes)

    @cached_property
    def start(self) -> float:
        """The earliest start over all events; 0.0 if there are none."""
        return min(map(_START, self._collected), default=0.0)

    @cached_property
    def makespan(self) -> float:
        """Latest end minus earliest start over all events; 0.0 if there are none."""
        if not self._collected:
            return 0.0
        return max(map(_END, self._collected)) - self.start

    @cached_property
    def bubble_fraction(self) -> float:
        """Share of rank-time (``num_ranks × makespan``) not spent in :data:`BUSY_KINDS`
        events; 0.0 if makespan is 0.

        Everything but compute (``F``, ``B``, ``W``) and the optimizer step (``STEP``) is
        bubble: idle time, and communication, namely a send's work on the sending rank
        (packing the message, its ``SEND_*`` event), a receive's wait and copy
        (``RECV_*``), all-reduces (``ALLREDUCE``, ``LOSS``). A measured timeline and a
        simulated one are judged alike: the simulator gives each action an event of the
        kind the runtime records it as, on the same rank.
        """
        if self.makespan == 0.0:
            return 0.0
        busy = sum(e.end - e.start for e in self._collected if e.kind in BUSY_KINDS)
        return 1.0 - busy / (self.num_ranks * self.makespan)

    @cached_property
    def peak_activations(self) -> list[int]:
        """Per rank, the most (stage, micro-batch) pairs held at once.

        A pair is held from the start of its ``"F"`` event to the end of its ``"B"`` event,
        or of its ``"W"`` event where the backward is split. At equal times releases happen
        before acquisitions, so a backward that ends exactly when the next forward starts
        frees its slot first.
        """
        return [_peak_held(lane) for lane in self._by_rank]

    def busy_time(self, rank: int) -> float:
        """Total duration of ``rank``'s :data:`BUSY_KINDS` events, in seconds."""
        return sum(e.duration for e in self.rank_events(rank) if e.kind in BUSY_KINDS)

    def rank_events(self, rank: int) -> list[Event]:
        """``rank``'s events, sorted by start time."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} is outside [0, {self.num_ranks})")
        return list(self._by_rank[rank])

    def shifted(self) -> Timeline:
        """The same events with times moved so that the earliest start is 0."""
        offset = self.start
        moved = (
            Event(e.rank, e.kind, e.stage, e.microbatch, e.start - offset, e.end - offset)
            for e in self.events
        )
        return Timeline(moved, self.num_ranks, self.label)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dictionary that :meth:`from_dict` turns back into an equal timeline."""
        events = [{name: getattr(e, name) for name in _EVENT_FIELDS} for e in self.events]
        return versioned(
            FORMAT_VERSION, {"label": self.label, "num_ranks": self.num_ranks, "events": events}
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timeline:
        """Rebuild a timeline from :meth:`to_dict`'s output (a missing ``format_version`` is
        taken as the current one)."""
        fields = unversioned(data, "timeline", FORMAT_VERSION, default=FORMAT_VERSION)
        missing = [key for key in ("num_ranks", "events") if key not in fields]
        if missing:
            raise ValueError(f"timeline dictionary lacks key(s) {missing}; use Timeline.to_dict")
        events = []
        for item in fields["events"]:
            absent = [name for name in _EVENT_FIELDS if name not in item]
            if absent:
                raise ValueError(f"timeline event {item!r} lacks field(s) {absent}")
            events.append(Event(**{name: item[name] for name in _EVENT_FIELDS}))
        return cls(events, fields["num_ranks"], fields.get("label", ""))

    def to_chrome_trace(self, path: StrPath) -> None:
        """Write a Chrome/Perfetto trace: one thread per rank, times in microseconds.

        Open the file in https://ui.perfetto.dev or chrome://tracing. Times keep the
        timeline's own origin; call :meth:`shifted` first to start at zero.
        """
        process = {"name": self.label or "pipetrain"}
        trace_events: list[dict[str, Any]] = [_metadata("process_name", None, process)]
        for rank in range(self.num_ranks):
            trace_events.append(_metadata("thread_name", rank, {"name": f"rank {rank}"}))
            trace_events.append(_metadata("thread_sort_index", rank, {"sort_index": rank}))
        for e in self.events:
            trace_events.append(
                {
                    "name": e.name,
                    "cat": e.kind,
                    "ph": "X",
                    "pid": 0,
                    "tid": e.rank,
                    "ts": e.start * 1e6,
                    "dur": e.duration * 1e6,
                    "args": {"stage": e.stage, "microbatch": e.microbatch},
                }
            )
        write_json(path, {"traceEvents": trace_events, "displayTimeUnit": "ms"})

    def plot(self, path: StrPath, title: str | None = None) -> None:
        """Draw the timeline as a PNG Gantt chart, one lane per rank.

        ``title`` defaults to the timeline's label; the bubble fraction and makespan follow it.
        :mod:`pipetrain.timeline.gantt` describes how each kind is drawn.
        """
        plot_timelines([self], path, None if title is None else [title])

    def summary(self) -> str:
        """A few readable lines: makespan, bubble fraction, peak activations per rank."""
        heading = self.label or "timeline"
        return "\n".join(
            [
                f"{heading}: {self.num_ranks} ranks, {len(self.events)} events",
                f"  makespan          {format_seconds(self.makespan)}",
                f"  bubble fraction   {self.bubble_fraction:.1%}",
                f"  peak activations  {self.peak_activations} (per rank)",
            ]
        )


def _peak_held(lane: Sequence[Event]) -> int:
    """The most (stage, micro-batch) pairs held at once on one rank's events: from the
    forward to the end of the backward, or of the W where the backward is split (the
    weight gradient reads the activations)."""
    release, acquire = 0, 1  # sort order: releases first at equal times
    ends: dict[tuple[int | None, int | None], float] = {}
    for e in lane:
        if e.kind in ("B", "W"):
            pair = (e.stage, e.microbatch)
            ends[pair] = max(ends.get(pair, e.end), e.end)
    changes = [(e.start, acquire, (e.stage, e.microbatch)) for e in lane if e.kind == "F"]
    changes += [(end, release, pair) for pair, end in ends.items()]
    changes.sort(key=lambda change: change[:2])
    held: set[tuple[int | None, int | None]] = set()
    peak = 0
    for _, change, pair in changes:
        if change == acquire:
            held.add(pair)
            peak = max(peak, len(held))
        else:
            held.discard(pair)
    return peak


def _metadata(name: str, rank: int | None, args: dict[str, Any]) -> dict[str, Any]:
    """A Chrome trace metadata event for the process (``rank`` None) or a rank's thread."""
    event: dict[str, Any] = {"name": name, "ph": "M", "pid": 0, "args": args}
    if rank is not None:
        event["tid"] = rank
    return event


def plot_timelines(
    timelines: Sequence[Timeline], path: StrPath, titles: Sequence[str] | None = None
) -> None:
    """Draw several timelines stacked on one PNG with a shared time axis.

    Each timeline is shifted to start at 0, so a predicted and a measured run of the same
    schedule line up. ``titles`` (one per timeline) default to the timelines' labels.
    """
    from pipetrain.timeline.gantt import draw_gantt  # matplotlib is imported only when drawing

    draw_gantt(timelines, path, titles)
