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
import torch.nn.functional as F
from torch import Tensor, nn

from pipetrain.app.models.gpt import build_gpt, gpt_loss
from pipetrain.app.models.hf import build_hf_gpt2, build_hf_llama, hf_example, hf_loss
from pipetrain.app.models.mlp import build_mlp, build_uneven_mlp
from pipetrain.app.models.vision import build_cnn, build_vgg
from pipetrain.model.frontend import front_end

MODEL_NAMES = ("mlp", "cnn", "gpt", "uneven-mlp", "vgg", "hf-gpt2", "hf-llama")
TEXT_MODELS = frozenset({"gpt", "hf-gpt2", "hf-llama"})

_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "mlp": build_mlp,
    "cnn": build_cnn,
    "gpt": build_gpt,
    "uneven-mlp": build_uneven_mlp,
    "vgg": build_vgg,
    "hf-gpt2": build_hf_gpt2,
    "hf-llama": build_hf_llama,
}


def _classification_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of class logits (N, C) against labels (N,)."""
    return F.cross_entropy(logits, targets)


_LOSSES: dict[str, Callable[[Any, Tensor], Tensor]] = {
    "mlp": _classification_loss,
    "cnn": _classification_loss,
    "gpt": gpt_loss,
    "uneven-mlp": _classification_loss,
    "vgg": _classification_loss,
    "hf-gpt2": hf_loss,
    "hf-llama": hf_loss,
}


def _check_name(name: str) -> None:
    """Raise a ValueError listing the built-in models when ``name`` is not one of them."""
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")


def build_model(name: str, *, seed: int = 0, **options: object) -> nn.Module:
    """Build built-in model ``name`` with weights initialised deterministically from ``seed``.

    ``options`` are the builder's keyword arguments, e.g. ``hidden=256`` for ``"mlp"`` or
    ``n_layers=8`` for ``"gpt"``. The global random state is left untouched.
    """
    _check_name(name)
    builder = _BUILDERS[name]
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
    _check_name(name)
    return hf_example() if name.startswith("hf-") else None


def model_layers(name: str, seed: int = 0) -> int:
    """How many layers (segments, for a captured model) built-in model ``name`` has."""
    return len(front_end(build_model(name, seed=seed), example_inputs(name)).layers)


def loss_function(name: str) -> Callable[[Any, Tensor], Tensor]:
    """The mean-reduced training loss for built-in model ``name``: ``loss(outputs, targets)``."""
    _check_name(name)
    return _LOSSES[name]


__all__ = [
    "MODEL_NAMES",
    "TEXT_MODELS",
    "build_model",
    "example_inputs",
    "loss_function",
    "model_layers",
]
