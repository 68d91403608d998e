"""Mixed precision on one rank: the autocast around each stage's passes and, for fp16, the
loss scale shared by every rank.

``"bf16"`` runs every forward (and its recomputation) under :func:`torch.autocast` with
bfloat16; ``"fp16"`` with float16, and scales the loss's gradient as
:class:`torch.amp.GradScaler` does: the last stage starts its backward from ``scale``
instead of 1, every rank unscales its gradients before the update, and an update whose
unscaled gradients are not finite on any rank is skipped on every rank while the scale
backs off. Each rank keeps its own copy of the scale; they stay equal because every rank
updates it from the same all-reduced verdict. The scale's arithmetic is GradScaler's own
(``torch._amp_foreach_non_finite_check_and_unscale_`` and ``torch._amp_update_scale_``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipetrain.runtime.rank.shard import local

PRECISIONS = ("fp32", "bf16", "fp16")
_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: str) -> None:
    """Raise ValueError for a precision that is not one of :data:`PRECISIONS`."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")


@dataclass(frozen=True)
class LossScale:
    """The fp16 loss scale's policy, :class:`torch.amp.GradScaler`'s arguments and defaults:
    start at ``init_scale``, multiply by ``backoff_factor`` at every update whose gradients
    overflowed, and by ``growth_factor`` after ``growth_interval`` updates in a row without."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        """Refuse a policy that cannot scale: a non-positive scale or interval, a growth
        factor not above 1, a back-off factor outside (0, 1)."""
        if not (
            self.init_scale > 0
            and self.growth_factor > 1
            and 0 < self.backoff_factor < 1
            and self.growth_interval >= 1
        ):
            raise ValueError(
                f"LossScale needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 "
                f"and growth_interval >= 1, got {self}"
            )


class Precision:
    """One rank's mixed-precision settings and, for ``"fp16"``, its loss scale, which
    follows ``loss_scale`` exactly as :class:`torch.amp.GradScaler` would."""

    def __init__(
        self, precision: str, device: torch.device, loss_scale: LossScale = LossScale()
    ) -> None:
        """Settings for ``precision`` on ``device``."""
        check_precision(precision)
        self.precision, self.device, self.policy = precision, device, loss_scale
        self._scale = torch.full((), loss_scale.init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.zeros((), dtype=torch.int32, device=device)

    @property
    def scales_loss(self) -> bool:
        """Whether gradients carry a loss scale (fp16)."""
        return self.precision == "fp16"

    @property
    def scale(self) -> float:
        """The current loss scale (1 without fp16)."""
        return float(self._scale) if self.scales_loss else 1.0

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context a stage's forward runs in."""
        dtype = _AUTOCAST_DTYPES.get(self.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def loss_grad(self, loss: torch.Tensor) -> torch.Tensor:
        """The gradient a loss's backward starts from: the scale under fp16, else 1."""
        if self.scales_loss:
            return self._scale.to(loss.dtype).expand_as(loss).clone()
        return torch.ones_like(loss)

    def unscale_(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Divide the gradients of ``tensors`` by the scale, in place (fp16 only); return 1.0
        if one of them is not finite, else 0.0 (a float32 tensor on the device)."""
        found_inf = torch.zeros((), dtype=torch.float32, device=self.device)
        if not self.scales_loss:
            return found_inf
        grads = [local(t.grad) for t in tensors if t.grad is not None]
        inv_scale = self._scale.double().reciprocal().float()
        for group in _by_device_and_dtype(grads):
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)
        return found_inf

    def update(self, overflowed: bool) -> None:
        """Back the scale off after an overflow, else count towards its growth (fp16 only)."""
        if not self.scales_loss:
            return
        found_inf = torch.full((), float(overflowed), dtype=torch.float32, device=self.device)
        torch._amp_update_scale_(
            self._scale,
            self._growth_tracker,
            found_inf,
            self.policy.growth_factor,
            self.policy.backoff_factor,
            self.policy.growth_interval,
        )

    def state_dict(self) -> dict[str, Any]:
        """The loss scale's state, to save with a checkpoint."""
        return {"scale": float(self._scale), "growth_tracker": int(self._growth_tracker)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict`."""
        self._scale.fill_(float(state["scale"]))
        self._growth_tracker.fill_(int(state["growth_tracker"]))


def _by_device_and_dtype(grads: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    return list(groups.values())
