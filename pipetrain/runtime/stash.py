"""Weight stashing for asynchronous schedules (PipeDream, PipeDream-2BW).

Each weight version a stage still needs is a detached snapshot of its parameters. A
forward runs the stage module through :func:`torch.func.functional_call` on the snapshot
its action names, so its backward differentiates exactly those weights; the optimizer
updates the live parameters, which no graph has saved, and the result becomes the next
snapshot. Nothing is swapped in place under autograd.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class WeightStash:
    """The weight versions of one stage; version ``v`` is the weights after ``v`` updates."""

    def __init__(self, module: nn.Module) -> None:
        """Start with the module's current weights as the newest version."""
        self.module = module
        self.live = dict(module.named_parameters())
        # buffers (such as running statistics) are shared by every version and updated in place
        self.buffers = dict(module.named_buffers())
        self.newest = 0
        self.versions: dict[int, dict[str, torch.Tensor]] = {0: self._snapshot()}

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {
            name: p.detach().clone().requires_grad_(p.requires_grad)
            for name, p in self.live.items()
        }

    def run(self, version: int, *inputs: torch.Tensor):
        """Run the stage on weight ``version``; gradients will accumulate on that version."""
        if version not in self.versions:
            raise RuntimeError(
                f"weight version {version} is no longer stashed (kept: {sorted(self.versions)})"
            )
        return torch.func.functional_call(
            self.module, {**self.versions[version], **self.buffers}, inputs
        )

    def trainable(self, version: int) -> list[torch.Tensor]:
        """Version ``version``'s tensors of the trainable parameters, in the module's order."""
        weights = self.versions[version]
        return [weights[name] for name, parameter in self.live.items() if parameter.requires_grad]

    def load_gradients(self) -> None:
        """Move the gradients of the backwards since the last update, whatever versions they
        used, into the live parameters' ``.grad``."""
        for name, parameter in self.live.items():
            grads = [
                weights[name].grad
                for weights in self.versions.values()
                if weights[name].grad is not None
            ]
            parameter.grad = sum(grads[1:], grads[0]) if grads else None
        for weights in self.versions.values():
            for tensor in weights.values():
                tensor.grad = None

    def advance(self) -> None:
        """Record the live weights (just updated) as the next version."""
        self.newest += 1
        self.versions[self.newest] = self._snapshot()

    def reset(self) -> None:
        """Make the live weights (loaded from outside) the only version, keeping its number."""
        self.versions = {self.newest: self._snapshot()}

    def keep_only(self, needed: Iterable[int]) -> None:
        """Drop every version that is neither needed later nor the newest."""
        keep = set(needed) | {self.newest}
        for version in [v for v in self.versions if v not in keep]:
            del self.versions[version]
