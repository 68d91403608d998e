"""Built-in models that need no download: MLPs and a CNN for 8x8 digits, a byte-level GPT.

Every model is an ``nn.Sequential`` whose entries are the pipeline layers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipetrain.app.models.gpt import build_gpt, gpt_loss
from pipetrain.app.models.mlp import build_mlp, build_uneven_mlp
from pipetrain.app.models.vision import build_cnn

MODEL_NAMES = ("mlp", "cnn", "gpt", "uneven-mlp")

_BUILDERS: dict[str, Callable[..., nn.Sequential]] = {
    "mlp": build_mlp,
    "cnn": build_cnn,
    "gpt": build_gpt,
    "uneven-mlp": build_uneven_mlp,
}


def _classification_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of class logits (N, C) against labels (N,)."""
    return F.cross_entropy(logits, targets)


_LOSSES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "mlp": _classification_loss,
    "cnn": _classification_loss,
    "gpt": gpt_loss,
    "uneven-mlp": _classification_loss,
}


def _check_name(name: str) -> None:
    """Raise a ValueError listing the built-in models when ``name`` is not one of them."""
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")


def build_model(name: str, *, seed: int = 0, **options: object) -> nn.Sequential:
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


def loss_function(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    """The mean-reduced training loss for built-in model ``name``: ``loss(outputs, targets)``."""
    _check_name(name)
    return _LOSSES[name]


__all__ = ["MODEL_NAMES", "build_model", "loss_function"]
