"""A per-worker memory limit for a schedule given by hand whose weights live in a host store
(``train --schedule roundpipe --worker-memory SIZE``): the predicted peak of its workers
(:mod:`pipetrain.planning.host_store`) checked before any worker starts, refused with the
figure and the fixes that would fit."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from pipetrain.planning.host_store import RESIDENT_OPTION, STAGES_OPTION, balanced_peaks
from pipetrain.profiler.costs import Profile
from pipetrain.schedules import build, spec
from pipetrain.units import format_bytes

Balancer = Callable[[int, int], Sequence[int]]
"""Layers per stage for ``(layers, stages)``: how the run will split the model."""


def even_balance(layers: int, stages: int) -> list[int]:
    """``layers`` shared out evenly over ``stages``, the first ones one more where they do
    not divide (as the runtime splits a model given no balance)."""
    return [layers // stages + (1 if i < layers % stages else 0) for i in range(stages)]


def host_schedule_peak(
    profile: Profile,
    schedule: str,
    ranks: int,
    microbatches: int,
    options: Mapping[str, int | bool],
    balance: Sequence[int] | None = None,
    recompute: str = "never",
) -> tuple[float, int]:
    """The highest predicted worker peak of ``schedule`` (a family whose weights live in a
    host store) with these settings, in bytes, and the rank that has it; ``balance``
    (layers per stage) by default shares the profile's layers evenly over its stages."""
    family = spec(schedule)
    if not family.host_weights:
        raise ValueError(
            f"{schedule} keeps its weights on its workers: plan it with --plan auto "
            "--worker-memory instead"
        )
    stages = _dealt_stages(schedule, ranks, microbatches, options)
    layers = len(profile.layers)
    split = list(balance) if balance is not None else even_balance(layers, stages)
    if len(split) != stages:
        raise ValueError(
            f"--balance gives {len(split)} stages, {schedule} deals {stages}; give "
            f"--{STAGES_OPTION.replace('_', '-')} {len(split)} or a balance of {stages} stages"
        )
    resident = int(family.resolve(options).get(RESIDENT_OPTION, 1))
    peaks = balanced_peaks(profile, split, ranks, microbatches, resident, recompute)
    peak = max(peaks)
    return peak, peaks.index(peak)


def check_worker_memory(
    profile: Profile,
    schedule: str,
    ranks: int,
    microbatches: int,
    options: Mapping[str, int | bool],
    limit: float,
    balance: Sequence[int] | None = None,
    recompute: str = "never",
) -> float:
    """The predicted worker peak of ``schedule`` (see :func:`host_schedule_peak`), or a
    ValueError when it exceeds ``limit`` bytes that gives the figure and each fix that
    would fit: more model stages, one stage resident at a time, recomputation, or a
    smaller batch (``profile`` is at the run's micro-batch size)."""
    peak, rank = host_schedule_peak(
        profile, schedule, ranks, microbatches, options, balance, recompute
    )
    if peak <= limit:
        return peak
    stages = _dealt_stages(schedule, ranks, microbatches, options)
    resolved = spec(schedule).resolve(options)
    # (flag, options, recomputation, balance) of each fix
    tries: list[tuple[str, Mapping[str, int | bool], str, Sequence[int] | None]] = []
    if 2 * stages <= len(profile.layers):  # finer stages: fewer weights at once
        flag = f"--{STAGES_OPTION.replace('_', '-')} {2 * stages}"
        tries.append((flag, {**options, STAGES_OPTION: 2 * stages}, recompute, None))
    if int(resolved.get(RESIDENT_OPTION, 1)) > 1:
        flag = f"--{RESIDENT_OPTION} 1"
        tries.append((flag, {**options, RESIDENT_OPTION: 1}, recompute, balance))
    if recompute != "always":
        tries.append(("--recompute always", options, "always", balance))
    fixes = []
    for flag, tried, mode, split in tries:
        need, _ = host_schedule_peak(profile, schedule, ranks, microbatches, tried, split, mode)
        fixes.append(f"{flag} ({format_bytes(need)}{'' if need <= limit else ', still over'})")
    fixes.append("a smaller --batch-size (every micro-batch's activations are held at once)")
    raise ValueError(
        f"{schedule} with {stages} model stages on {ranks} ranks and {microbatches} "
        f"micro-batches needs {format_bytes(peak)} on rank {rank} (the weights and gradients "
        "of the stages it holds at once, its stages' activations and messages), over "
        f"--worker-memory {format_bytes(limit)}; give {', or '.join(fixes)}"
    )


def _dealt_stages(
    schedule: str, ranks: int, microbatches: int, options: Mapping[str, int | bool]
) -> int:
    """The model stages ``schedule`` deals with these settings (ValueError for settings it
    refuses, naming them)."""
    given: dict[str, int | bool] = dict(options)
    return build(schedule, ranks, microbatches, replicas=None, **given).stages
