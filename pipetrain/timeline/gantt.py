"""PNG Gantt charts of timelines: one lane per rank, time across.

Compute (forward, backward, weight gradient, optimizer step) fills the upper part of each
lane; communication and waits run in a thin hatched strip below it, so they never hide
compute. Every ``SEND_*`` and ``RECV_*`` kind draws as a send or a receive, and the loss
all-reduce ``LOSS`` as an all-reduce; a stage's weights loaded from the host store
(``LOAD``) and its gradients returned (``OFFLOAD``) draw in the same strip, overlapping the
compute they run beside. Idle time shows as the lane's light grey background.
When a rank holds several stages (interleaved schedules) each of its stages gets a lighter
shade of the kind's colour. Drawing uses one polygon collection per kind and shade, so very
large timelines stay fast.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np

from pipetrain.units import format_seconds, time_unit

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.patches import Patch
    from numpy.typing import ArrayLike

    from pipetrain.timeline.timeline import StrPath, Timeline

COMPUTE_COLOURS = {"F": "#3b75af", "B": "#e07b20", "W": "#7b4fa6", "STEP": "#3a3a3a"}
COMPUTE_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient", "STEP": "optimizer step"}
COMM_STYLES = {  # legend name, face colour, hatch; legend order follows this order
    "SEND": ("send", "#b9d7ea", "////"),
    "RECV": ("receive", "#c8e6c3", "\\\\\\\\"),
    "ALLREDUCE": ("all-reduce", "#f6dc8a", "xxxx"),
    "GATHER": ("gather", "#d9c3e8", "++++"),
    "LOAD": ("load weights", "#c6e2df", "||||"),
    "OFFLOAD": ("return gradients", "#ead2b5", "----"),
    "WAIT": ("wait", "#f3b6ae", "...."),
}
"""Communication kinds by prefix: ``SEND_F``, ``SEND_T`` and any other ``SEND_*`` are sends."""
COMM_ALIASES = {"LOSS": "ALLREDUCE"}
"""Kinds drawn with another kind's :data:`COMM_STYLES` entry (matched whole, not by prefix)."""
OTHER_COLOURS = ("#8c564b", "#c45a9a", "#8f9a2a", "#2a9a9a")
IDLE_COLOUR = "#eeeeee"

COMPUTE_BAND = (-0.40, 0.22)  # lane-relative y extent of compute bars (rank at 0)
COMM_BAND = (0.26, 0.42)  # thin strip below the compute bars
MAX_LABELLED_EVENTS = 2500  # beyond this, text on bars is unreadable and slow
MAX_HATCHED_EVENTS = 4000  # beyond this, bars are slivers: plain fill draws faster
DPI = 110

_LegendKey = tuple[int, int, int, str]  # (group, position in group, chunk, kind) sorts entries


@dataclass
class _Layer:
    """All bars of one colour in one panel, drawn as a single collection."""

    colour: str
    band: tuple[float, float]
    hatch: str | None = None
    lefts: list[float] = field(default_factory=list)
    rights: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)


def draw_gantt(
    timelines: Sequence[Timeline], path: StrPath, titles: Sequence[str] | None = None
) -> None:
    """Draw ``timelines`` stacked vertically on one PNG at ``path``, sharing the time axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    timelines = list(timelines)
    if not timelines:
        raise ValueError("plot_timelines needs at least one timeline, got none")
    if titles is not None and len(titles) != len(timelines):
        raise ValueError(
            f"got {len(titles)} titles for {len(timelines)} timelines; give one per timeline"
        )
    shifted = [t.shifted() for t in timelines]
    span = max(t.makespan for t in shifted)
    scale, unit = time_unit(span)
    width = _figure_width(shifted)
    lane_height = _lane_height(sum(t.num_ranks for t in shifted))
    heights = [t.num_ranks * lane_height + 0.75 for t in shifted]
    figure = Figure(figsize=(width, sum(heights) + 0.6), dpi=DPI, layout="constrained")
    axes = figure.subplots(len(shifted), 1, sharex=True, squeeze=False, height_ratios=heights)
    legend: dict[_LegendKey, Patch] = {}
    for index, (timeline, ax) in enumerate(zip(shifted, axes[:, 0])):
        heading = titles[index] if titles is not None else timeline.label
        _draw_panel(ax, timeline, heading, scale, span, width, legend)
    axes[-1, 0].set_xlabel(f"time ({unit})")
    axes[-1, 0].set_xlim(0.0, span * scale * 1.01 if span > 0 else 1.0)
    handles = [legend[key] for key in sorted(legend)]
    figure.legend(handles=handles, loc="outside right upper", fontsize=8)
    FigureCanvasAgg(figure).print_png(path)


def _draw_panel(
    ax: Axes,
    timeline: Timeline,
    heading: str,
    scale: float,
    span: float,
    figure_width: float,
    legend: dict[_LegendKey, Patch],
) -> None:
    """Draw one timeline on ``ax`` and add the kinds it uses to ``legend``."""
    ranks = range(timeline.num_ranks)
    ax.set_ylim(timeline.num_ranks - 0.5, -0.5)  # rank 0 at the top
    lane_length = timeline.makespan * scale
    ax.barh(list(ranks), lane_length, height=0.9, left=0.0, color=IDLE_COLOUR, zorder=0)
    layers = _layers(timeline, legend)
    many = len(timeline.events) > MAX_LABELLED_EVENTS
    for layer in layers.values():
        _draw_layer(ax, layer, scale, outline=not many)
    if not many:
        _label_bars(ax, timeline, scale, span, figure_width, layers)
    step = max(1, timeline.num_ranks // 32)
    ax.set_yticks(list(ranks[::step]), [f"rank {r}" for r in ranks[::step]], fontsize=8)
    ax.tick_params(axis="y", length=0)
    ax.grid(axis="x", color="#cccccc", linewidth=0.6, zorder=-1)
    ax.set_axisbelow(True)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    if timeline.num_ranks <= 32:
        _annotate_peaks(ax, timeline)
    if not timeline.events:
        ax.text(0.5, 0.5, "no events", transform=ax.transAxes, ha="center", va="center")
    title = heading or "timeline"
    ax.set_title(
        f"{title} — bubble {timeline.bubble_fraction:.1%} — "
        f"makespan {format_seconds(timeline.makespan)}",
        fontsize=10,
        loc="left",
    )


def _layers(timeline: Timeline, legend: dict[_LegendKey, Patch]) -> dict[tuple[str, int], _Layer]:
    """Group the events into one layer per (kind, stage shade), registering legend entries."""
    from matplotlib.patches import Patch

    chunk_of = _stage_chunks(timeline)
    chunks = max((len(c) for c in chunk_of), default=1)
    layers: dict[tuple[str, int], _Layer] = {}
    others: dict[str, str] = {}
    for event in timeline.events:
        style = _comm_key(event.kind)
        if style is not None:
            name, colour, hatch = COMM_STYLES[style]
            key, band, entry = (name, -1), COMM_BAND, name  # chunk -1: never a compute key
            order = (2, list(COMM_STYLES).index(style), 0, "")
        else:
            chunk = chunk_of[event.rank].get(event.stage, 0)
            base = COMPUTE_COLOURS.get(event.kind) or others.setdefault(
                event.kind, OTHER_COLOURS[len(others) % len(OTHER_COLOURS)]
            )
            colour, hatch = _shade(base, chunk, chunks), None
            key, band = (event.kind, chunk), COMPUTE_BAND
            entry = COMPUTE_NAMES.get(event.kind, event.kind)
            if chunks > 1:
                entry += f" (chunk {chunk + 1})"
            if event.kind in COMPUTE_COLOURS:
                order = (0, list(COMPUTE_COLOURS).index(event.kind), chunk, "")
            else:
                order = (1, 0, chunk, event.kind)
        if key not in layers:
            layers[key] = _Layer(colour, band, hatch)
            edge = "#555555" if hatch else colour
            patch = Patch(facecolor=colour, hatch=hatch, edgecolor=edge, label=entry)
            legend.setdefault(order, patch)
        layer = layers[key]
        layer.lefts.append(event.start)
        layer.rights.append(event.end)
        layer.ranks.append(event.rank)
    hatched = sum(len(layer.lefts) for layer in layers.values() if layer.hatch)
    if hatched > MAX_HATCHED_EVENTS:
        for layer in layers.values():
            layer.hatch = None
    return layers


def _draw_layer(ax: Axes, layer: _Layer, scale: float, outline: bool) -> None:
    """Add one layer's bars to ``ax`` as a single polygon collection."""
    from matplotlib.collections import PolyCollection

    left = np.asarray(layer.lefts) * scale
    right = np.asarray(layer.rights) * scale
    rank = np.asarray(layer.ranks, dtype=float)
    top, bottom = rank + layer.band[0], rank + layer.band[1]
    xs = np.stack([left, right, right, left], axis=1)
    ys = np.stack([top, top, bottom, bottom], axis=1)
    corners = np.stack([xs, ys], axis=2)  # (bars, 4 corners, x/y)
    edge = "#666666" if layer.hatch else ("white" if outline else "none")
    collection = PolyCollection(
        # the stubs ask for a sequence; a 3-D array is what matplotlib draws fastest
        cast("Sequence[ArrayLike]", corners),
        facecolors=layer.colour,
        edgecolors=edge,
        linewidths=0.4 if outline or layer.hatch else 0.0,
        hatch=layer.hatch,
        zorder=2,
    )
    ax.add_collection(collection)


def _label_bars(
    ax: Axes,
    timeline: Timeline,
    scale: float,
    span: float,
    figure_width: float,
    layers: dict[tuple[str, int], _Layer],
) -> None:
    """Write the micro-batch number on compute bars wide enough to hold it."""
    if span <= 0:
        return
    pixels_per_second = figure_width * 0.75 * DPI / span  # the axes take >= 75% of the width
    chunk_of = _stage_chunks(timeline)
    middle = sum(COMPUTE_BAND) / 2
    for event in timeline.events:
        if event.microbatch is None or _comm_key(event.kind) is not None:
            continue
        text = str(event.microbatch)
        if event.duration * pixels_per_second < 6.5 * len(text) + 4:
            continue
        colour = layers[(event.kind, chunk_of[event.rank].get(event.stage, 0))].colour
        ax.text(
            (event.start + event.end) / 2 * scale,
            event.rank + middle,
            text,
            ha="center",
            va="center",
            fontsize=7.5,
            color="white" if _luminance(colour) < 0.55 else "black",
            zorder=3,
            clip_on=True,
        )


def _annotate_peaks(ax: Axes, timeline: Timeline) -> None:
    """Write each rank's peak in-flight activations to the right of its lane."""
    from matplotlib.transforms import blended_transform_factory

    at_right = blended_transform_factory(ax.transAxes, ax.transData)
    labels = [(-0.5, "peak act.", "bottom")]
    labels += [(rank, str(peak), "center") for rank, peak in enumerate(timeline.peak_activations)]
    for y, text, align in labels:
        ax.text(1.005, y, text, va=align, transform=at_right, fontsize=7, color="#555555")


def _stage_chunks(timeline: Timeline) -> list[dict[int | None, int]]:
    """Per rank, each stage it computes mapped to its position among that rank's stages."""
    stages: list[set[int]] = [set() for _ in range(timeline.num_ranks)]
    for event in timeline.events:
        if event.stage is not None and _comm_key(event.kind) is None:
            stages[event.rank].add(event.stage)
    return [{stage: i for i, stage in enumerate(sorted(held))} for held in stages]


def _comm_key(kind: str) -> str | None:
    """The :data:`COMM_STYLES` key that draws ``kind``; ``None`` for kinds that are not
    communication."""
    if kind in COMM_ALIASES:
        return COMM_ALIASES[kind]
    return next((prefix for prefix in COMM_STYLES if kind.startswith(prefix)), None)


def _shade(colour: str, chunk: int, chunks: int) -> str:
    """``colour`` mixed with white: not at all for the first chunk, up to 50% for the last."""
    if chunks <= 1 or chunk == 0:
        return colour
    mix = 0.5 * chunk / (chunks - 1)
    rgb = [int(colour[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * mix):02x}" for c in rgb)


def _luminance(colour: str) -> float:
    """Perceived brightness of a ``#rrggbb`` colour, 0 (black) to 1 (white)."""
    red, green, blue = (int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5))
    return 0.299 * red + 0.587 * green + 0.114 * blue


def _figure_width(timelines: Sequence[Timeline]) -> float:
    """Inches: wider for more compute per rank, between 8 and 22."""
    busiest = max(
        sum(1 for e in t.rank_events(rank) if _comm_key(e.kind) is None)
        for t in timelines
        for rank in range(t.num_ranks)
    )
    return float(np.clip(5.0 + 0.28 * busiest, 8.0, 22.0))


def _lane_height(total_ranks: int) -> float:
    """Inches per rank lane, shrinking so that the figure stays about 13 inches tall or less."""
    return float(np.clip(12.0 / max(total_ranks, 1), 0.12, 0.45))
