"""Pipeline schedules as data: build, validate, read and write per-rank action lists.

>>> s = build("1f1b", ranks=4, microbatches=8)
>>> s.compute_order(3)[:4]
['F3.0', 'B3.0', 'F3.1', 'B3.1']
>>> Schedule.from_text(s.describe()) == s
True

- :mod:`~pipetrain.schedules.actions`: :class:`Action` and :class:`Kind`;
- :mod:`~pipetrain.schedules.schedule`: :class:`Schedule` and its text form;
- :mod:`~pipetrain.schedules.messages`: what every send and receive carries;
- :mod:`~pipetrain.schedules.lower`: the passes that add communication;
- :mod:`~pipetrain.schedules.validate`: the validator and :class:`ScheduleError`;
- :mod:`~pipetrain.schedules.registry`: :class:`ScheduleSpec`, :func:`register`, :func:`build`;
- :mod:`~pipetrain.schedules.builtin`: one file per built-in family.
"""

from pipetrain.schedules import builtin as _builtin  # noqa: F401  (registers the families)
from pipetrain.schedules.actions import (
    COMPUTE_KINDS,
    RECV_KINDS,
    SEND_KINDS,
    WRITTEN_KINDS,
    Action,
    Kind,
)
from pipetrain.schedules.errors import ScheduleError
from pipetrain.schedules.lower import forward_only, lower, with_targets_shipped
from pipetrain.schedules.registry import (
    MAX_RANK_MICROBATCHES,
    Generated,
    Option,
    ScheduleSpec,
    build,
    names,
    register,
    spec,
    unregister,
)
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.validate import validate

RECOMPUTE_MODES = ("never", "except_last", "always")
"""Recomputation modes, cheapest first: none, every micro-batch but the last, every
micro-batch (on every stage)."""

__all__ = [
    "COMPUTE_KINDS",
    "MAX_RANK_MICROBATCHES",
    "RECOMPUTE_MODES",
    "RECV_KINDS",
    "SEND_KINDS",
    "WRITTEN_KINDS",
    "Action",
    "Generated",
    "Kind",
    "Option",
    "Schedule",
    "ScheduleError",
    "ScheduleSpec",
    "build",
    "forward_only",
    "lower",
    "names",
    "register",
    "spec",
    "unregister",
    "validate",
    "with_targets_shipped",
]
