"""Deferred batch normalization: running statistics of the whole mini-batch, not of each
micro-batch.

Under a pipeline every batch-normalization layer normalizes each micro-batch with that
micro-batch's own statistics and, by default, updates its running statistics once per
micro-batch, exactly as the unpipelined model run micro-batch by micro-batch.
:class:`DeferredBatchNorm` (torchgpipe's idea) still normalizes each micro-batch with its
own statistics, but only accumulates them; after the step's last micro-batch it updates
the running statistics (and ``num_batches_tracked``) once, from the whole mini-batch, as
the unpipelined model run on the whole batch would. The accumulators are buffers, so a
recomputed forward, whose buffer writes are undone, does not count twice; they are not
saved (``persistent=False``), so a converted model's state dict keeps its keys.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from pipetrain.model.layers import Layer
from pipetrain.schedules import Schedule


class DeferredBatchNorm(_BatchNorm):
    """A batch normalization whose running statistics are updated once per ``chunks``
    training forwards (the micro-batches of a step), from all of them together.

    Made by :func:`convert_deferred_batch_norm` from ``nn.BatchNorm1d``/``2d``/``3d``
    layers; in eval mode it normalizes with the running statistics as they do.
    """

    sum: torch.Tensor  # of the step's inputs so far, per channel
    sum_squares: torch.Tensor
    counted: torch.Tensor  # values per channel so far
    forwards: torch.Tensor  # training forwards so far in the step

    def __init__(self, layer: _BatchNorm, chunks: int) -> None:
        """Take over ``layer``'s parameters and running statistics (shared, not copied)."""
        if not layer.track_running_stats:
            raise ValueError(
                "DeferredBatchNorm defers running statistics; a layer built with "
                "track_running_stats=False has none, so leave it as it is"
            )
        super().__init__(layer.num_features, layer.eps, layer.momentum, layer.affine, True)
        self.chunks, self._input_dims = chunks, _input_dims(layer)
        for name in ("weight", "bias"):
            setattr(self, name, getattr(layer, name))
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            setattr(self, name, getattr(layer, name))
        assert self.running_mean is not None  # track_running_stats
        zeros = torch.zeros_like(self.running_mean)
        self.register_buffer("sum", zeros.clone(), persistent=False)
        self.register_buffer("sum_squares", zeros.clone(), persistent=False)
        self.register_buffer("counted", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("forwards", torch.zeros((), dtype=torch.long), persistent=False)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() not in self._input_dims:
            raise ValueError(f"expected {self._input_dims} dimensions, got {input.dim()}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input`` with its own statistics (training) and count them, or with
        the running statistics (eval)."""
        if not self.training:
            return super().forward(input)
        self._check_input_dim(input)
        with torch.no_grad():
            dims = [d for d in range(input.dim()) if d != 1]
            values = input.detach().to(self.sum.dtype)
            self.sum += values.sum(dims)
            self.sum_squares += values.square().sum(dims)
            self.counted += input.numel() // input.shape[1]
            self.forwards += 1
            if int(self.forwards) == self.chunks:
                self._commit()
        return nn.functional.batch_norm(
            input, None, None, self.weight, self.bias, True, 0.0, self.eps
        )

    def _commit(self) -> None:
        """Update the running statistics from the step's accumulated ones, then reset."""
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        count = int(self.counted)
        mean = self.sum / count
        variance = (self.sum_squares / count - mean.square()) * (count / max(count - 1, 1))
        self.num_batches_tracked += 1
        momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
        self.running_var.mul_(1 - momentum).add_(variance, alpha=momentum)
        for buffer in (self.sum, self.sum_squares, self.counted, self.forwards):
            buffer.zero_()


def _input_dims(layer: _BatchNorm) -> tuple[int, ...]:
    if isinstance(layer, nn.BatchNorm1d):
        return (2, 3)
    if isinstance(layer, nn.BatchNorm2d):
        return (4,)
    if isinstance(layer, nn.BatchNorm3d):
        return (5,)
    raise TypeError(f"cannot defer a {type(layer).__name__}: only nn.BatchNorm1d, 2d and 3d layers")


def convert_deferred_batch_norm(module: nn.Module, chunks: int) -> nn.Module:
    """``module`` with every ``nn.BatchNorm1d``/``2d``/``3d`` that tracks running statistics
    (itself or inside it) replaced by a :class:`DeferredBatchNorm` that updates them once
    per ``chunks`` training forwards; the parameters and statistics are shared. Only layers
    present as modules are converted (a model traced to a graph has none left)."""
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)) and (
        module.track_running_stats
    ):
        return DeferredBatchNorm(module, chunks).train(module.training)
    for name, child in module.named_children():
        converted = convert_deferred_batch_norm(child, chunks)
        if converted is not child:
            setattr(module, name, converted)
    return module


def deferred_layers(layers: Sequence[Layer], schedule: Schedule) -> list[Layer]:
    """``layers`` converted (:func:`convert_deferred_batch_norm`) for ``schedule``'s steps;
    ValueError for a schedule whose stages do not see every micro-batch of a step."""
    replicas = [len(ranks) for ranks in schedule.stage_ranks]
    if schedule.asynchronous or max(replicas) > 1:
        why = "it updates inside the step" if schedule.asynchronous else f"replicas={replicas}"
        raise ValueError(
            f"deferred_batch_norm needs every micro-batch of a step on one rank per stage; "
            f"{schedule.name} ({why}) does not: use a synchronous schedule without replicas"
        )
    return [(name, convert_deferred_batch_norm(m, schedule.microbatches)) for name, m in layers]
