"""Per-layer times with the layers run in turn, as a pipeline stage runs them.

:func:`time_in_sequence` gives the times that :func:`pipetrain.profiler.measure.profile`
records; :class:`Timer` reads a clock that waits for the device.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from pipetrain.profiler.costs import Spread
from pipetrain.profiler.values import Values, as_values, fresh_inputs

LossFn = Callable[[Any, Any], Tensor]
"""A loss function: ``loss_fn(outputs, targets)`` returns a scalar tensor."""

OptimizerFactory = Callable[[list[Tensor]], torch.optim.Optimizer]
"""Builds an optimizer over a list of parameters, such as ``torch.optim.Adam``."""


class Timer:
    """Wall-clock timing that waits for queued device work before reading the clock."""

    def __init__(self, device: torch.device) -> None:
        """Time work on ``device``."""
        self.device = device
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        """Seconds on a monotonic clock, after the device finished its queued work."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def time_in_sequence(
    layers: Sequence[tuple[str, nn.Module]],
    arguments: Values,
    targets: object,
    loss_fn: LossFn,
    timer: Timer,
    repeats: int,
    warmup: int,
    optimizer: OptimizerFactory,
) -> tuple[list[tuple[float, float, float]], Spread]:
    """Per layer, median forward, backward and optimizer-step times with the layers run in
    turn, as a stage runs them, and every timed run's forward and backward times: all
    forwards, then the backwards in reverse order, then an optimizer step per layer (on
    copies of its weights). Timing a layer alone, over and over, keeps its weights in cache
    and comes out faster than what a pipeline sees.

    Timing each layer's backward needs a backward call per layer, and each call has a fixed
    cost that a stage, which runs its layers' backward as one call, pays only once (it came
    to 40% of the backward on a small MLP). So every run also times the whole model's
    forward, backward and optimizer step in one call each, and the per-layer medians (and
    runs) are scaled so that the medians add up to those totals' medians. A step taken
    right after the backward that made its gradients is slower than one repeated on old
    gradients (often by a third or more for Adam on a CPU), so the whole model's step is
    taken that way, as a stage takes it.
    """
    count = len(layers)
    times: list[list[list[float]]] = [[[], [], []] for _ in range(count)]
    whole: list[list[float]] = [[], [], []]
    trainable = trainable_parameters(layers)
    whole_stepper = optimizer(trainable) if trainable else None
    steppers: list[torch.optim.Optimizer | None] = []
    for _, module in layers:
        copies = [
            p.detach().clone().requires_grad_(True) for p in module.parameters() if p.requires_grad
        ]
        for copy in copies:
            copy.grad = torch.randn_like(copy)
        steppers.append(optimizer(copies) if copies else None)
    for _ in range(warmup + repeats):
        # the layers' backwards make fresh gradients, the whole model's backward adds to
        # them (as all but a step's first micro-batch do), and the step reads them fresh
        for parameter in trainable:
            parameter.grad = None
        saved: list[tuple[Values, Values]] = []
        inputs = arguments
        for index, (_, module) in enumerate(layers):
            leaves, fed = fresh_inputs(inputs)
            start = timer.now()
            output = module(*fed)
            if index == count - 1:
                output = loss = loss_fn(output, targets)
            times[index][0].append(timer.now() - start)
            outputs = as_values(output)
            saved.append((leaves, outputs))
            inputs = outputs
        incoming: list[Tensor | None] = [torch.ones_like(loss)]
        for index in reversed(range(count)):
            leaves, outputs = saved[index]
            pairs = [
                (o, g)
                for o, g in zip(outputs, incoming)
                if isinstance(o, Tensor) and o.requires_grad and g is not None
            ]
            start = timer.now()
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            times[index][1].append(timer.now() - start)
            incoming = [x.grad if isinstance(x, Tensor) else None for x in leaves]
        for kind, elapsed in enumerate(
            _whole_model(layers, arguments, targets, loss_fn, timer, whole_stepper)
        ):
            whole[kind].append(elapsed)
        for index, stepper in enumerate(steppers):
            if stepper is None:
                times[index][2].append(0.0)
                continue
            start = timer.now()
            stepper.step()
            times[index][2].append(timer.now() - start)
    medians = [[statistics.median(kind[warmup:]) for kind in layer] for layer in times]
    runs: list[list[list[float]]] = [[], [], []]
    for kind in (0, 1, 2):
        total = sum(layer[kind] for layer in medians)
        scale = statistics.median(whole[kind][warmup:]) / total if total > 0 else 1.0
        for layer in medians:
            layer[kind] *= scale
        runs[kind] = [
            [layer[kind][run] * scale for layer in times] for run in range(warmup, warmup + repeats)
        ]
    return [(f, b, o) for f, b, o in medians], Spread(runs[0], runs[1])


def _whole_model(
    layers: Sequence[tuple[str, nn.Module]],
    arguments: Values,
    targets: object,
    loss_fn: LossFn,
    timer: Timer,
    stepper: torch.optim.Optimizer | None,
) -> tuple[float, float, float]:
    """Seconds for one forward of all layers (and the loss), one backward call through them,
    and one ``stepper`` step on the gradients just made (0 without one)."""
    _, inputs = fresh_inputs(arguments)
    start = timer.now()
    for _, module in layers:
        output = module(*inputs)
        inputs = as_values(output)
    loss = loss_fn(output, targets)
    forward_s = timer.now() - start
    start = timer.now()
    loss.backward()
    backward_s = timer.now() - start
    if stepper is None:
        return forward_s, backward_s, 0.0
    start = timer.now()
    stepper.step()
    return forward_s, backward_s, timer.now() - start


def trainable_parameters(layers: Sequence[tuple[str, nn.Module]]) -> list[Tensor]:
    """The layers' trainable parameters, each once: a parameter two layers share (tied
    weights) is stepped and copied once."""
    return list(
        {id(p): p for _, module in layers for p in module.parameters() if p.requires_grad}.values()
    )


def time_weight_version(
    parameters: Sequence[Tensor], timer: Timer, repeats: int, warmup: int
) -> float:
    """Median seconds for what an asynchronous update does to ``parameters`` besides the
    optimizer's step: a detached copy of every one (the next weight version, as
    :class:`pipetrain.runtime.rank.weights.WeightStash` keeps it) and the 2-norm of them all
    (the update's finiteness check reads its gradients' norm; the weights stand in for
    gradients of the same size). 0 for no parameters."""
    if not parameters:
        return 0.0
    times = []
    with torch.no_grad():
        for _ in range(warmup + repeats):
            start = timer.now()
            copies = [p.detach().clone() for p in parameters]
            torch._foreach_norm(copies)
            times.append(timer.now() - start)
            del copies
    return statistics.median(times[warmup:])
