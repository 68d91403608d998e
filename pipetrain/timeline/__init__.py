"""Timelines: what each rank did when, predicted by the simulator or measured by the runtime.

:class:`Timeline` holds :class:`Event` s and derives the makespan, bubble fraction and peak
activations; it saves as JSON, exports a Chrome/Perfetto trace and draws a PNG Gantt chart.
:func:`format_seconds` and :func:`time_unit` come from :mod:`pipetrain.units`.
"""

from pipetrain.timeline.timeline import (
    BUSY_KINDS,
    Event,
    StrPath,
    Timeline,
    plot_timelines,
    trusted_event,
)
from pipetrain.units import format_seconds, time_unit

__all__ = [
    "BUSY_KINDS",
    "Event",
    "StrPath",
    "Timeline",
    "format_seconds",
    "plot_timelines",
    "time_unit",
    "trusted_event",
]
