"""What layers take and return, as the profiler handles it: values cut to a micro-batch,
moved to a device, sized in bytes and detached into fresh autograd leaves.

A value is a tensor, anything else a layer accepts, or a tuple, list or dict of values.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

Values = tuple[object, ...]
"""A layer's positional inputs, or its outputs as a tuple."""


def as_values(output: object) -> Values:
    """A layer's output as a tuple: a tuple or list item by item, anything else alone."""
    return tuple(output) if isinstance(output, (tuple, list)) else (output,)


def fresh_inputs(arguments: Values) -> tuple[Values, Values]:
    """Detached inputs (floating-point ones require a gradient) and what to feed the layer.

    The layer gets copies of the floating-point leaves, so that in-place layers such as
    ``ReLU(inplace=True)`` do not modify a leaf that requires a gradient.
    """
    leaves = tuple(
        x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, Tensor) else x
        for x in arguments
    )
    fed = tuple(x.clone() if isinstance(x, Tensor) and x.is_floating_point() else x for x in leaves)
    return leaves, fed


def first(value: object, size: int) -> object:
    """The first ``size`` samples of a tensor, or of every tensor in a tuple/list/dict."""
    if isinstance(value, Tensor):
        return value[:size] if value.dim() > 0 else value
    if isinstance(value, (tuple, list)):
        return type(value)(first(v, size) for v in value)
    if isinstance(value, dict):
        return {k: first(v, size) for k, v in value.items()}
    return value


def to_device(value: object, device: torch.device) -> object:
    """``value`` with every tensor moved to ``device``."""
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def tensors(output: object) -> list[Tensor]:
    """The tensors of a layer output (a tensor or a tuple/list of them)."""
    return [x for x in as_values(output) if isinstance(x, Tensor)]


def nbytes(values: Iterable[object], size: int | None = None) -> float:
    """Total bytes of the tensors among ``values``, each cut to ``size`` samples when given."""
    total = 0
    for value in values:
        if isinstance(value, Tensor):
            counted = value[:size] if size is not None and value.dim() > 0 else value
            total += counted.numel() * counted.element_size()
    return float(total)
