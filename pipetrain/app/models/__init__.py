"""Built-in models that need no download: MLPs, a CNN and a VGG-style network for 8x8
digits, a byte-level GPT, and stock Hugging Face GPT-2 and Llama classes for the same bytes.

The first five are ``nn.Sequential`` models whose entries are the pipeline layers; the
``hf-*`` ones are captured as graphs (:func:`example_inputs` is their capture sample).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from pipetrain.app.model_registry import MODEL_NAMES, model_spec
from pipetrain.model.frontend import front_end


def build_model(name: str, *, seed: int = 0, **options: object) -> nn.Module:
    """Build built-in model ``name`` with weights initialised deterministically from ``seed``.

    ``options`` are the builder's keyword arguments, e.g. ``hidden=256`` for ``"mlp"`` or
    ``n_layers=8`` for ``"gpt"``. The global random state is left untouched.
    """
    builder = model_spec(name).build_function()
    accepted = inspect.signature(builder).parameters
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(
            f"model {name!r} has no option {', '.join(unknown)}; "
            f"its options are {', '.join(accepted)}"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return builder(**options)


def example_inputs(name: str) -> Tensor | None:
    """The sample a graph-captured built-in model is captured on (``None`` for layers)."""
    if not model_spec(name).captured:
        return None
    from pipetrain.app.models.hf import hf_example

    return hf_example()


def model_layers(name: str, seed: int = 0) -> int:
    """How many layers (segments, for a captured model) built-in model ``name`` has, counted
    on the built model (its registry entry's ``layers`` says it without building)."""
    return len(front_end(build_model(name, seed=seed), example_inputs(name)).layers)


def loss_function(name: str) -> Callable[[Any, Tensor], Tensor]:
    """The mean-reduced training loss for built-in model ``name``: ``loss(outputs, targets)``."""
    return model_spec(name).loss_function()


__all__ = [
    "MODEL_NAMES",
    "build_model",
    "example_inputs",
    "loss_function",
    "model_layers",
]
