"""Measure a model's per-layer costs on one device: :func:`profile`.

Times come from the layers run one after another, as a pipeline stage runs them: all
forwards, the backwards in reverse order with the weight gradients accumulating, then an
optimizer step per layer. (A layer timed alone, over and over, keeps its weights in cache and
looks faster than a pipeline finds it.) Those per-layer times are scaled to add up to the
whole model's forward, backward and optimizer step, each timed as one call, as a stage
runs them. Each layer is also run alone on its real input, the previous layer's output
detached and marked as requiring a gradient, for its sizes and for how its backward
splits into input and weight gradients. The model is left exactly as it was found.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from pipetrain.model.layers import to_layers
from pipetrain.profiler.costs import LayerCost, Profile, Spread

LossFn = Callable[[Any, Any], Tensor]


def profile(
    model: nn.Module | Sequence[nn.Module],
    sample_inputs: Tensor | tuple[Tensor, ...],
    sample_targets: Any,
    loss_fn: LossFn,
    microbatch_size: int | None = None,
    device: torch.device | str | None = None,
    repeats: int = 5,
    warmup: int = 2,
    optimizer_state_factor: float = 2.0,
    optimizer: Callable[[list[Tensor]], torch.optim.Optimizer] | None = None,
) -> Profile:
    """Measure forward and backward time, activation, weight and memory sizes of every layer.

    Layers come from :func:`pipetrain.model.layers.to_layers`. ``sample_inputs`` (a tensor or a
    tuple of tensors fed to the first layer) and ``sample_targets`` are cut to the first
    ``microbatch_size`` samples (default: all of them). Times are medians over ``repeats``
    runs after ``warmup`` untimed runs, in training mode. The last layer's forward and
    backward include ``loss_fn(output, targets)``.

    Per layer:

    - ``forward_s``, ``backward_s`` and ``optimizer_s`` come from the layers run in sequence;
      they are scaled so that they add up to the whole model's forward, backward and
      optimizer step, each timed as one call (the step right after the backward, on the
      gradients it made, as a stage steps at the end of a training step). Every timed run's
      forward and backward times, on the same scale, are kept in the profile's
      :class:`~pipetrain.profiler.costs.Spread`.
      ``weight_backward_s`` is ``backward_s`` times the weight-gradient share measured on
      the layer alone, where ``torch.autograd.grad`` with respect to the inputs and
      parameters is timed against the inputs only (0 for a layer without parameters, all of
      the backward when the input has no gradient, such as token ids).
    - ``optimizer_bytes`` assumes Adam: ``optimizer_state_factor`` (2) times the bytes of
      the trainable parameters (two moment estimates).
    - ``optimizer_s`` is one step of ``optimizer`` (a function from parameters to an
      optimizer; default Adam): timed per layer on copies of the layer's trainable
      parameters, and for the whole model on the parameters themselves (put back after).
    - ``peak_memory_bytes`` on CUDA is the rise of ``torch.cuda.max_memory_allocated``
      over one forward and backward; on other devices it is an estimate, the output
      activation plus the weight gradients.

    Parameters, gradients (``None`` stays ``None``), buffers such as BatchNorm running
    statistics, train/eval modes, the device and the global random state are restored
    afterwards.
    """
    _check_counts(repeats, warmup, optimizer_state_factor)
    layers = to_layers(model)
    container = model if isinstance(model, nn.Module) else nn.ModuleList(m for _, m in layers)
    inputs = sample_inputs if isinstance(sample_inputs, tuple) else (sample_inputs,)
    size = _microbatch_size(inputs, microbatch_size)
    with _preserved(container, device) as target_device:
        arguments = tuple(_to(_first(x, size), target_device) for x in inputs)
        targets = _to(_first(sample_targets, size), target_device)
        timer = _Timer(target_device)
        container.train()
        costs = []
        first_arguments = arguments
        for index, (name, module) in enumerate(layers):
            is_last = index == len(layers) - 1
            measured = _LayerRun(module, arguments, targets if is_last else None, loss_fn, timer)
            costs.append(measured.cost(name, repeats, warmup, optimizer_state_factor))
            arguments = measured.output
        timed, spread = _in_sequence(
            layers,
            first_arguments,
            targets,
            loss_fn,
            timer,
            repeats,
            warmup,
            optimizer or torch.optim.Adam,
        )
        for cost, (forward_s, backward_s, optimizer_s) in zip(costs, timed):
            share = (
                cost.weight_backward_s / cost.backward_s
                if cost.weight_backward_s and cost.backward_s
                else 0.0
            )
            cost.forward_s, cost.backward_s, cost.optimizer_s = forward_s, backward_s, optimizer_s
            if cost.weight_backward_s is not None:
                cost.weight_backward_s = share * backward_s
    return Profile(costs, microbatch_size=size, input_bytes=_bytes(inputs, size), spread=spread)


def _in_sequence(
    layers: Sequence[tuple[str, nn.Module]],
    arguments: tuple,
    targets: Any,
    loss_fn: LossFn,
    timer: _Timer,
    repeats: int,
    warmup: int,
    optimizer: Callable,
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
    trainable = [p for _, module in layers for p in module.parameters() if p.requires_grad]
    whole_stepper = optimizer(trainable) if trainable else None
    steppers = []
    for _, module in layers:
        copies = [
            p.detach().clone().requires_grad_(True) for p in module.parameters() if p.requires_grad
        ]
        for copy in copies:
            copy.grad = torch.randn_like(copy)
        steppers.append(optimizer(copies) if copies else None)
    for run in range(warmup + repeats):
        # the layers' backwards make fresh gradients, the whole model's backward adds to
        # them (as all but a step's first micro-batch do), and the step reads them fresh
        for parameter in trainable:
            parameter.grad = None
        saved, inputs = [], arguments
        for index, (_, module) in enumerate(layers):
            leaves, fed = _fresh_inputs(inputs)
            start = timer.now()
            output = module(*fed)
            if index == count - 1:
                output = loss_fn(output, targets)
            times[index][0].append(timer.now() - start)
            outputs = tuple(output) if isinstance(output, (tuple, list)) else (output,)
            saved.append((leaves, outputs))
            inputs = outputs
        incoming: list[Tensor | None] = [torch.ones_like(saved[-1][1][0])]
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
    return [tuple(layer) for layer in medians], Spread(runs[0], runs[1])


def _whole_model(
    layers: Sequence[tuple[str, nn.Module]],
    arguments: tuple,
    targets: Any,
    loss_fn: LossFn,
    timer: _Timer,
    stepper: torch.optim.Optimizer | None,
) -> tuple[float, float, float]:
    """Seconds for one forward of all layers (and the loss), one backward call through them,
    and one ``stepper`` step on the gradients just made (0 without one)."""
    _, inputs = _fresh_inputs(arguments)
    start = timer.now()
    for _, module in layers:
        output = module(*inputs)
        inputs = tuple(output) if isinstance(output, (tuple, list)) else (output,)
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


def _fresh_inputs(arguments: tuple) -> tuple[tuple, tuple]:
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


class _Timer:
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


class _LayerRun:
    """One layer measured on fixed inputs: forward, full backward and input-only backward."""

    def __init__(
        self, module: nn.Module, arguments: tuple, targets: Any, loss_fn: LossFn, timer: _Timer
    ) -> None:
        """Measure ``module`` on ``arguments``; ``targets`` (not None) means it is the last layer."""
        self.module, self.arguments, self.targets = module, arguments, targets
        self.loss_fn, self.timer = loss_fn, timer
        self.parameters = [p for p in module.parameters() if p.requires_grad]
        self.output: tuple = ()

    def _forward(self) -> tuple[tuple, list[Tensor], float]:
        """Run the layer (and the loss on the last layer); return inputs, roots, seconds."""
        leaves, fed = _fresh_inputs(self.arguments)
        start = self.timer.now()
        output = self.module(*fed)
        roots = (
            [self.loss_fn(output, self.targets)] if self.targets is not None else _tensors(output)
        )
        elapsed = self.timer.now() - start
        self.output = tuple(output) if isinstance(output, (tuple, list)) else (output,)
        return leaves, [r for r in roots if r.requires_grad], elapsed

    def _backward(self, roots: list[Tensor], wrt: list[Tensor]) -> float:
        """Seconds for autograd.grad of ``roots`` with respect to ``wrt``."""
        if not roots or not wrt:
            return 0.0
        start = self.timer.now()
        torch.autograd.grad(
            roots, wrt, grad_outputs=[torch.ones_like(r) for r in roots], allow_unused=True
        )
        return self.timer.now() - start

    def cost(
        self, name: str, repeats: int, warmup: int, optimizer_state_factor: float
    ) -> LayerCost:
        """Time the layer and size its output, weights and memory."""
        forward, full, inputs_only = [], [], []
        for run in range(warmup + repeats):
            leaves, roots, forward_s = self._forward()
            differentiable = [x for x in leaves if isinstance(x, Tensor) and x.requires_grad]
            full_s = self._backward(roots, differentiable + self.parameters)
            _, roots, _ = self._forward()
            inputs_s = self._backward(roots, differentiable)
            if run >= warmup:
                forward.append(forward_s)
                full.append(full_s)
                inputs_only.append(inputs_s)
        backward_s = statistics.median(full)
        parameter_bytes = _bytes(tuple(self.module.parameters()))
        trainable_bytes = _bytes(tuple(self.parameters))
        activation_bytes = _bytes(self.output)
        return LayerCost(
            forward_s=statistics.median(forward),
            backward_s=backward_s,
            activation_bytes=activation_bytes,
            parameter_bytes=parameter_bytes,
            weight_backward_s=self._weight_share(backward_s, statistics.median(inputs_only)),
            optimizer_bytes=optimizer_state_factor * trainable_bytes,
            peak_memory_bytes=self._peak_memory(activation_bytes + trainable_bytes),
            name=name,
        )

    def _weight_share(self, backward_s: float, inputs_only_s: float) -> float:
        """The weight-gradient part of the backward, clamped into [0, backward_s]."""
        if not self.parameters:
            return 0.0
        if inputs_only_s == 0.0:
            return backward_s
        return min(max(backward_s - inputs_only_s, 0.0), backward_s)

    def _peak_memory(self, estimate: float) -> float:
        """Peak allocation of one forward and backward on CUDA; ``estimate`` elsewhere."""
        if not self.timer.cuda:
            return estimate
        device = self.timer.device
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        leaves, roots, _ = self._forward()
        differentiable = [x for x in leaves if isinstance(x, Tensor) and x.requires_grad]
        self._backward(roots, differentiable + self.parameters)
        return float(max(torch.cuda.max_memory_allocated(device) - base, 0))


@contextmanager
def _preserved(container: nn.Module, device: torch.device | str | None) -> Iterator[torch.device]:
    """Run the body on ``device`` and put back every parameter, gradient, buffer and mode."""
    parameters = list(container.parameters())
    home = parameters[0].device if parameters else torch.device("cpu")
    target = torch.device(device) if device is not None else home
    saved_data = [p.detach().clone() for p in parameters]
    saved_grads = [None if p.grad is None else p.grad.detach().clone() for p in parameters]
    saved_buffers = [b.detach().clone() for b in container.buffers()]
    modes = [(m, m.training) for m in container.modules()]
    cuda_devices = [target] if target.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda_devices):
            if target != home:
                container.to(target)
            yield target
    finally:
        if target != home:
            container.to(home)
        with torch.no_grad():
            for parameter, data, grad in zip(parameters, saved_data, saved_grads):
                parameter.copy_(data)
                parameter.grad = grad
            for buffer, value in zip(container.buffers(), saved_buffers):
                buffer.copy_(value)
        for module, training in modes:
            module.train(training)


def _check_counts(repeats: int, warmup: int, optimizer_state_factor: float) -> None:
    """Reject non-positive repeats, negative warm-up and negative optimizer factors."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative integer, got {warmup!r}")
    if optimizer_state_factor < 0:
        raise ValueError(
            f"optimizer_state_factor must be >= 0 (2 for Adam, 1 for SGD with momentum), got {optimizer_state_factor!r}"
        )


def _microbatch_size(inputs: tuple, requested: int | None) -> int:
    """The micro-batch size to profile at: ``requested``, or the sample batch size."""
    tensors = [x for x in inputs if isinstance(x, Tensor) and x.dim() > 0]
    if not tensors:
        raise ValueError("sample_inputs must contain at least one tensor with a batch dimension")
    available = tensors[0].shape[0]
    if requested is None:
        return int(available)
    if (
        isinstance(requested, bool)
        or not isinstance(requested, int)
        or not 1 <= requested <= available
    ):
        raise ValueError(
            f"microbatch_size {requested!r} must be an integer between 1 and the sample batch size {available}"
        )
    return requested


def _first(value: Any, size: int) -> Any:
    """The first ``size`` samples of a tensor, or of every tensor in a tuple/list/dict."""
    if isinstance(value, Tensor):
        return value[:size] if value.dim() > 0 else value
    if isinstance(value, (tuple, list)):
        return type(value)(_first(v, size) for v in value)
    if isinstance(value, dict):
        return {k: _first(v, size) for k, v in value.items()}
    return value


def _to(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor moved to ``device``."""
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def _tensors(output: Any) -> list[Tensor]:
    """The tensors of a layer output (a tensor or a tuple/list of them)."""
    if isinstance(output, Tensor):
        return [output]
    return [x for x in output if isinstance(x, Tensor)]


def _bytes(values: tuple, size: int | None = None) -> float:
    """Total bytes of the tensors in ``values`` (cut to ``size`` samples when given)."""
    tensors = [_first(v, size) if size is not None else v for v in values if isinstance(v, Tensor)]
    return float(sum(t.numel() * t.element_size() for t in tensors))
