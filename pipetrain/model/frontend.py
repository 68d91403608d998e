"""Front-ends: how a model becomes stage modules.

A model given as layers (an ``nn.Sequential``, a list of modules, or a module with
``pipeline_layers()``) keeps its layers; any other ``nn.Module`` is captured as a graph
(:class:`~pipetrain.model.graph.GraphModel`). Both offer the same calls: ``layers``
(named, runnable in order), ``stage(start, stop)`` (a stage module under the full model's
names), ``parameter_sizes()`` (what a default cut balances, or ``None`` for an even one),
``inputs`` (a step's inputs as the first stage's tensors) and ``outputs`` (the last stage's
tensors as the model returns them). :func:`shared_parameters` finds parameters that several stages
use, whichever the front-end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipetrain.model.capture import Inputs
from pipetrain.model.graph import GraphModel
from pipetrain.model.layers import Layer, StageModule, stage_bounds, to_layers


class SequentialModel:
    """A model given as layers; a stage runs a range of them."""

    split = False

    def __init__(self, model: nn.Module | Sequence[nn.Module]) -> None:
        """The layers of ``model`` (see :func:`~pipetrain.model.layers.to_layers`)."""
        self.layers: list[Layer] = to_layers(model)

    def stage(self, start: int, stop: int, device: torch.device | None = None) -> nn.Module:
        """The module running layers ``start`` to ``stop - 1`` (``device``: unused, the
        layers make their tensors where their inputs are)."""
        return StageModule(self.layers[start:stop])

    def parameter_sizes(self) -> list[float] | None:
        """``None``: layers are shared out evenly unless a balance is given."""
        return None

    def inputs(self, inputs: Any) -> Any:
        """The inputs as given: a tensor or a tuple of tensors."""
        return inputs

    def outputs(self, tensors: Sequence[torch.Tensor]) -> Any:
        """One tensor, or a tuple of several."""
        return tensors[0] if len(tensors) == 1 else tuple(tensors)


FrontEnd = SequentialModel | GraphModel


def _given_as_layers(model: object) -> bool:
    return (
        isinstance(model, (nn.Sequential, nn.ModuleList, list, tuple))
        or callable(getattr(model, "pipeline_layers", None))
        or not isinstance(model, nn.Module)
    )


def front_end(
    model: nn.Module | Sequence[nn.Module] | GraphModel,
    example_inputs: Inputs | None = None,
    split_points: Sequence[str] | None = None,
) -> FrontEnd:
    """The front-end for ``model``: its layers, or its graph captured on ``example_inputs``
    and cut at ``split_points`` (module paths) or between its blocks; a
    :class:`~pipetrain.model.graph.GraphModel` (a model captured once) as it is, or its
    capture cut at ``split_points`` when they are given and differ from its own."""
    if isinstance(model, GraphModel):
        if split_points is None or list(split_points) == model.split_points:
            return model
        return model.cut_at(split_points)
    if _given_as_layers(model):
        if split_points is not None:
            raise ValueError(
                "split_points are for models captured as a graph; a model given as layers "
                "is cut by balance=[layers per stage]"
            )
        return SequentialModel(model)
    assert isinstance(model, nn.Module)
    if example_inputs is None:
        raise TypeError(
            f"a {type(model).__name__} is captured as a graph, which needs example_inputs: a "
            "sample of its inputs with at least 2 rows, such as {'input_ids': ids[:2]} "
            "(or give the model as a sequence of layers)"
        )
    return GraphModel(model, example_inputs, split_points)


@dataclass(frozen=True)
class SharedParameter:
    """A parameter that several stages use: its name on each of them."""

    names: dict[int, str]

    @property
    def stages(self) -> list[int]:
        """The stages holding it, in order."""
        return sorted(self.names)


def shared_parameters(front: FrontEnd, balance: Sequence[int]) -> list[SharedParameter]:
    """The parameters that more than one stage of ``balance`` uses, in model order."""
    holders: dict[int, dict[int, str]] = {}
    for stage, (start, stop) in enumerate(stage_bounds(balance)):
        module = front.stage(start, stop)
        for name, parameter in module.named_parameters(remove_duplicate=False):
            holders.setdefault(id(parameter), {}).setdefault(stage, name)
    return [SharedParameter(names) for names in holders.values() if len(names) > 1]
