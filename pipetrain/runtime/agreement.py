"""Ranks agree or stop: every rank compares the pipeline it was asked to build with rank 0's.

Ranks given different settings would not fail on their own: a layer that no rank holds,
or micro-batches that do not line up, train the wrong model or fail far from the cause.
:func:`check_agreement` gathers each rank's settings and model structure with one
all-gather, so every rank raises the same error, naming each differing setting and the
ranks that hold each value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields, is_dataclass
from typing import Any

import torch.distributed as dist

from pipetrain.model.layers import Layer
from pipetrain.schedules import Schedule

_LOCAL = ("device", "group", "timeout_s", "frozen_after_s")  # may differ between ranks without harm
_SHOWN = 120  # characters of a value shown in a message
_PLAIN = (bool, int, float, str, type(None))


def _comparable(value: Any) -> Any:
    """A setting as ranks can compare it: plain values as they are, a schedule as its text,
    a mapping sorted, a frozen dataclass (such as a loss scale) by its fields; anything
    else (a function, a tensor, a state dict) only by whether it was given."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, Schedule):
        return value.describe()
    if isinstance(value, Mapping) and all(isinstance(v, _PLAIN) for v in value.values()):
        return dict(sorted(value.items()))
    if isinstance(value, (list, tuple)) and all(isinstance(v, _PLAIN) for v in value):
        return value
    if is_dataclass(value) and not isinstance(value, type):
        return {item.name: _comparable(getattr(value, item.name)) for item in fields(value)}
    return f"a {type(value).__name__}"


def settings_of(layers: Sequence[Layer], *groups: Any, **more: Any) -> dict[str, Any]:
    """What every rank must agree on: every field of the settings objects ``groups``
    (such as the :class:`PipelineConfig`) but those that may differ between ranks, the
    model's structure (each layer's name and its parameters' and buffers' names, shapes
    and dtypes) and ``more``."""
    settings: dict[str, Any] = {}
    for group in groups:
        for item in fields(group):
            if item.name not in _LOCAL:
                settings[item.name] = _comparable(getattr(group, item.name))
    settings["model"] = [
        f"{name}.{key} {list(tensor.shape)} {tensor.dtype}"
        for name, module in layers
        for key, tensor in module.state_dict().items()
    ] + [f"layer {name}: {type(module).__name__}" for name, module in layers]
    settings.update({name: _comparable(value) for name, value in more.items()})
    return settings


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def _model_difference(mine: list[str], theirs: list[str]) -> str:
    """The first entry where two model descriptions differ."""
    for a, b in zip(mine, theirs):
        if a != b:
            return f"{a!r} against {b!r}"
    shorter, longer = sorted((mine, theirs), key=len)
    return f"{longer[len(shorter)]!r} only on one side"


def differences(gathered: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each setting on which some rank differs from rank 0, with the ranks holding each
    value (for the model, the first differing parameter)."""
    reference = gathered[0]
    found = []
    for name in dict.fromkeys(key for settings in gathered for key in settings):
        values = [settings.get(name) for settings in gathered]
        if all(value == values[0] for value in values):
            continue
        if name == "model":
            rank = next(r for r, value in enumerate(values) if value != values[0])
            detail = _model_difference(reference.get(name) or [], values[rank] or [])
            found.append(f"the model differs between rank 0 and rank {rank}: {detail}")
            continue
        holders: dict[str, list[int]] = {}
        for rank, value in enumerate(values):
            holders.setdefault(_shown(value), []).append(rank)
        found.append(
            f"{name}: "
            + "; ".join(
                f"{value} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
                for value, ranks in holders.items()
            )
        )
    return found


def check_agreement(settings: Mapping[str, Any], group: dist.ProcessGroup | None = None) -> None:
    """Compare this rank's ``settings`` with every other rank's of ``group`` (every rank calls
    it, with one all-gather).

    Raises:
        ValueError: on every rank, naming each setting that differs and the ranks of each
            value.
    """
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, dict(settings), group=group)
    found = differences(gathered)
    if found:
        raise ValueError(
            "the ranks were given different pipelines; give every rank the same settings: "
            + " | ".join(found)
        )
