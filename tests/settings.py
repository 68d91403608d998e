"""Pipeline settings for tests that give them as one flat set of keywords: each goes to the
settings object that holds it (PipelineConfig, UpdateConfig, RuntimeConfig, ModelSource)."""

from __future__ import annotations

from typing import Any

import pipetrain
from pipetrain.runtime import ModelSource, PipelineConfig, RuntimeConfig, UpdateConfig

_SCHEDULE = ("schedule", "microbatches", "balance", "recompute")
_CONFIG_ONLY = (
    "replicas",
    "schedule_options",
    "targets_on_first_stage",
    "data_parallel",
    "shard",
    "tensor_parallel",
    "tensor_parallel_plan",
)
_UPDATE = ("lr_scheduler", "on_nonfinite", "loss_scale")
_RUNTIME = ("timeout_s", "record", "bucket_bytes", "device", "group", "frozen_after_s")
_SOURCE = ("example_inputs", "init_fn", "weights", "deferred_batch_norm")


def grouped(flat: dict[str, Any]) -> dict[str, Any]:
    """``Pipeline``'s keywords for ``flat`` settings: a schedule setting that only a
    ``PipelineConfig`` holds brings the schedule's flat ones into it (unless a plan or a
    config is given, which then refuses them as Pipeline does)."""
    settings = dict(flat)
    moved = {name: settings.pop(name) for name in _CONFIG_ONLY if name in settings}
    if moved:
        if "plan" in settings or "config" in settings:
            raise ValueError(f"give {', '.join(moved)} inside config=")
        moved.update({name: settings.pop(name) for name in _SCHEDULE if name in settings})
        settings["config"] = PipelineConfig(**moved)
    for key, names, kind in (
        ("update", _UPDATE, UpdateConfig),
        ("runtime", _RUNTIME, RuntimeConfig),
        ("source", _SOURCE, ModelSource),
    ):
        given = {name: settings.pop(name) for name in names if name in settings}
        if given:
            settings[key] = kind(**given)
    return settings


def make_pipeline(*args: Any, **flat: Any) -> pipetrain.Pipeline:
    """``pipetrain.Pipeline(*args, ...)`` with ``flat`` settings grouped (see :func:`grouped`)."""
    return pipetrain.Pipeline(*args, **grouped(flat))
