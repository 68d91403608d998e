"""Pipeline schedules as data: build, validate and inspect per-rank action lists.

>>> s = build("1f1b", stages=4, microbatches=8)
>>> s.compute_order(3)[:4]
['F3.0', 'B3.0', 'F3.1', 'B3.1']
"""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.schedules import generators
from pipetrain.schedules.actions import (
    COMPUTE_KINDS,
    RECV_KINDS,
    SEND_KINDS,
    Action,
    Kind,
    Schedule,
)
from pipetrain.schedules.connect import connect
from pipetrain.schedules.validate import ScheduleError, validate

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1", "pipedream", "2bw")
SYNCHRONOUS = ("gpipe", "1f1b", "interleaved", "zb-h1")
RECOMPUTE_MODES = ("never", "except_last", "always")
"""Recomputation modes, cheapest first: none, every micro-batch but the last, every
micro-batch (on every stage)."""

__all__ = [
    "COMPUTE_KINDS",
    "RECOMPUTE_MODES",
    "RECV_KINDS",
    "SCHEDULE_NAMES",
    "SEND_KINDS",
    "SYNCHRONOUS",
    "Action",
    "Kind",
    "Schedule",
    "ScheduleError",
    "build",
    "validate",
]


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def build(
    name: str,
    stages: int,
    microbatches: int,
    *,
    virtual: int = 2,
    replicas: Sequence[int] | None = None,
    vertical_sync: bool = False,
    rounds: int = 2,
) -> Schedule:
    """Build and validate a schedule.

    ``stages`` is the pipeline depth (ranks, or stages when ``replicas`` is given);
    ``microbatches`` the micro-batches per optimizer step (for ``pipedream``, the number
    of mini-batches in the window). Options: ``virtual`` model chunks per rank for
    ``interleaved`` (which then has ``stages·virtual`` model stages); ``replicas`` ranks per
    stage for ``gpipe``, ``1f1b`` and ``pipedream``; ``vertical_sync`` for ``pipedream``; ``rounds`` of
    updates in the window for ``2bw``.
    """
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    _positive("stages", stages)
    _positive("microbatches", microbatches)
    if replicas is not None:
        if name not in ("gpipe", "1f1b", "pipedream"):
            raise ValueError(f"replicas are supported by gpipe, 1f1b and pipedream, not {name!r}")
        if len(replicas) != stages:
            raise ValueError(
                f"replicas {list(replicas)} has {len(replicas)} entries, expected one per stage ({stages})"
            )
        for count in replicas:
            _positive("every replica count", count)
    options: dict = {}
    split_backward = asynchronous = False
    model_stages, total = stages, microbatches
    if name == "gpipe":
        orders, stage_ranks = generators.gpipe(stages, microbatches, replicas)
    elif name == "1f1b":
        orders, stage_ranks = generators.one_f_one_b(stages, microbatches, replicas)
    elif name == "interleaved":
        _positive("virtual", virtual)
        if virtual < 2:
            raise ValueError(
                f"interleaved needs virtual >= 2 model chunks per rank, got {virtual}; use 1f1b for one"
            )
        if microbatches % stages:
            raise ValueError(
                f"interleaved needs microbatches to be a multiple of stages ({stages}), got {microbatches}"
            )
        orders, stage_ranks = generators.interleaved(stages, microbatches, virtual)
        model_stages, options["virtual"] = stages * virtual, virtual
    elif name == "zb-h1":
        orders, stage_ranks = generators.zero_bubble_h1(stages, microbatches)
        split_backward = True
    elif name == "pipedream":
        if vertical_sync and replicas is not None and max(replicas) > 1:
            raise ValueError(
                "vertical_sync needs every stage to update once per mini-batch, which replicated stages "
                f"(replicas {list(replicas)}) do not; use one or the other"
            )
        uneven = [r for r in replicas or () if microbatches % r]
        if uneven:
            raise ValueError(
                f"pipedream with replicas {list(replicas)} needs mini-batches in multiples of every replica "
                f"count, so replicas update together; got microbatches={microbatches}"
            )
        orders, stage_ranks = generators.pipedream(stages, microbatches, vertical_sync, replicas)
        asynchronous = True
        options.update(vertical_sync=vertical_sync, max_versions=sum(replicas or [1] * stages) + 1)
    else:
        _positive("rounds", rounds)
        if microbatches < stages:
            raise ValueError(
                f"2bw needs microbatches >= stages ({stages}) per update, got {microbatches}"
            )
        orders, stage_ranks = generators.two_bw(stages, microbatches, rounds)
        asynchronous, total = True, microbatches * rounds
        options.update(microbatches_per_update=microbatches, rounds=rounds, max_versions=2)
    schedule = Schedule(
        name=name,
        stages=model_stages,
        microbatches=total,
        ranks=connect(orders, stage_ranks),
        stage_ranks=tuple(stage_ranks),
        split_backward=split_backward,
        asynchronous=asynchronous,
        options=options,
    )
    validate(schedule)
    return schedule
