"""The built-in models, one entry each: :class:`ModelSpec`.

Every fact the commands need of a built-in model lives in its entry: how to build it and
its loss (named, so that reading the registry loads no torch), its data, its defaults, how
many layers it is cut into, and whether it is captured as a graph. Adding a model is one
entry here and its builder.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelSpec:
    """One built-in model.

    ``builder`` and ``loss`` name a function of :mod:`pipetrain.app.models` as
    ``"module:function"``; ``data`` is ``"text"`` (the byte corpus), ``"digits"`` (8x8
    images as a flat vector) or ``"images"`` (1x8x8); ``lr`` and ``batch_size`` are the
    defaults of ``pipetrain train``; ``layers`` counts the layers a pipeline cuts it into
    (a captured model's segments), checked against the built model by a test; ``captured``
    models are given to the pipeline whole and captured on their example inputs.
    """

    name: str
    builder: str
    loss: str
    data: str
    lr: float
    batch_size: int
    layers: int
    captured: bool = False

    @property
    def text(self) -> bool:
        """Whether the model is trained on the byte corpus."""
        return self.data == "text"

    def build_function(self) -> Callable[..., Any]:
        """The builder (imports the model's module, and torch)."""
        return _resolve(self.builder)

    def loss_function(self) -> Callable[..., Any]:
        """The mean-reduced training loss ``loss(outputs, targets)`` (imports torch)."""
        return _resolve(self.loss)


def _resolve(path: str) -> Callable[..., Any]:
    module, _, name = path.partition(":")
    function: Callable[..., Any] = getattr(
        importlib.import_module(f"pipetrain.app.models.{module}"), name
    )
    return function


_CLASSIFY = "losses:classification_loss"

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("mlp", "mlp:build_mlp", _CLASSIFY, "digits", 3e-3, 64, 5),
        ModelSpec("cnn", "vision:build_cnn", _CLASSIFY, "images", 3e-3, 64, 9),
        ModelSpec("gpt", "gpt:build_gpt", "gpt:gpt_loss", "text", 3e-3, 16, 6),
        ModelSpec("uneven-mlp", "mlp:build_uneven_mlp", _CLASSIFY, "digits", 3e-3, 64, 8),
        ModelSpec("vgg", "vision:build_vgg", _CLASSIFY, "images", 1e-3, 64, 13),
        ModelSpec("hf-gpt2", "hf:build_hf_gpt2", "hf:hf_loss", "text", 3e-3, 16, 6, True),
        ModelSpec("hf-llama", "hf:build_hf_llama", "hf:hf_loss", "text", 3e-3, 16, 6, True),
    )
}
MODEL_NAMES = tuple(MODELS)


def model_spec(name: str) -> ModelSpec:
    """The entry of built-in model ``name``; a ValueError lists the built-in models."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    return MODELS[name]
