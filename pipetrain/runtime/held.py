"""The parameters and buffers of the stages one rank holds, named as in the full model."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


class HeldStages:
    """This rank's view of its stage modules (``stages``, by stage index); ``reset_weights``
    is called after weights are loaded from outside."""

    stages: dict[int, nn.Module]

    def reset_weights(self) -> None:
        """Take note of weights loaded from outside (nothing to do by default)."""

    @property
    def training(self) -> bool:
        """Whether the stages are in training mode (as ``nn.Module.training``)."""
        return all(module.training for module in self.stages.values())

    def train(self, mode: bool = True) -> HeldStages:
        """Put every stage in training mode (``mode=False``: eval mode), as
        ``model.train()`` does: dropout, batch normalization and a captured model's graph
        follow it in ``train_step``; ``eval_step`` always runs eval mode."""
        for module in self.stages.values():
            module.train(mode)
        return self

    def eval(self) -> HeldStages:
        """Put every stage in eval mode (``train(False)``)."""
        return self.train(False)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters, named as in the full model."""
        for module in self.stages.values():
            yield from module.named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters."""
        for _, parameter in self.named_parameters():
            yield parameter

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers, keyed as in the full model."""
        state: dict[str, torch.Tensor] = {}
        for module in self.stages.values():
            state.update(module.state_dict())
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load this rank's entries from a (full or partial) state dict keyed as the full model."""
        for module in self.stages.values():
            keys = module.state_dict().keys()
            module.load_state_dict({k: v for k, v in state.items() if k in keys})
        self.reset_weights()
