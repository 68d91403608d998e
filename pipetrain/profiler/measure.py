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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from pipetrain.checks import is_int, non_negative_int, non_negative_number, positive_int
from pipetrain.model.frontend import front_end
from pipetrain.model.graph import GraphModel
from pipetrain.profiler.costs import LayerCost, Profile
from pipetrain.profiler.timing import (
    LossFn,
    OptimizerFactory,
    Timer,
    time_in_sequence,
    time_weight_version,
    trainable_parameters,
)
from pipetrain.profiler.values import (
    Values,
    as_values,
    first,
    fresh_inputs,
    nbytes,
    tensors,
    to_device,
)


def profile(
    model: nn.Module | Sequence[nn.Module],
    sample_inputs: Tensor | tuple[Tensor, ...] | dict[str, Any],
    sample_targets: Any,
    loss_fn: LossFn,
    microbatch_size: int | None = None,
    device: torch.device | str | None = None,
    repeats: int = 5,
    warmup: int = 2,
    optimizer_state_factor: float = 2.0,
    optimizer: OptimizerFactory | None = None,
) -> Profile:
    """Measure forward and backward time, activation, weight and memory sizes of every layer.

    Layers come from :func:`pipetrain.model.frontend.front_end`: a model given as layers
    keeps them, any other module is captured on ``sample_inputs`` and its segments are the
    layers (as :class:`~pipetrain.Pipeline` cuts it, so a plan's balance applies to both).
    ``sample_inputs`` (a tensor, a tuple of tensors fed to the first layer, or a captured
    model's dict of keyword inputs) and ``sample_targets`` are cut to the first
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
    - ``saved_bytes`` counts, on one forward, the storages autograd saves for the backward
      and the output's, leaving out the layer's inputs, weights and buffers.
    - ``optimizer_bytes`` assumes Adam: ``optimizer_state_factor`` (2) times the bytes of
      the trainable parameters (two moment estimates).
    - ``optimizer_s`` is one step of ``optimizer`` (a function from parameters to an
      optimizer; default Adam): timed per layer on copies of the layer's trainable
      parameters, and for the whole model on the parameters themselves (put back after).
    - The profile's ``weight_version_byte_s`` is what an asynchronous update spends a
      byte of weights besides the optimizer's step (copying the next weight version, the
      gradients' norm): :func:`~pipetrain.profiler.timing.time_weight_version` over the
      whole model's trainable parameters, over their bytes.
    - ``peak_memory_bytes`` on CUDA is the rise of ``torch.cuda.max_memory_allocated``
      over one forward and backward; on other devices it is an estimate, the output
      activation plus the weight gradients.

    Parameters, gradients (``None`` stays ``None``), buffers such as BatchNorm running
    statistics, train/eval modes, the device and the global random state are restored
    afterwards.
    """
    _check_counts(repeats, warmup, optimizer_state_factor)
    front = front_end(model, sample_inputs)
    layers = front.layers
    container = model if isinstance(model, nn.Module) else nn.ModuleList(m for _, m in layers)
    flat = front.inputs(sample_inputs)
    inputs = flat if isinstance(flat, tuple) else (flat,)
    if isinstance(front, GraphModel):
        loss_fn = _on_model_outputs(loss_fn, front)
    size = _microbatch_size(inputs, microbatch_size)
    with _preserved(container, device) as target_device:
        arguments = tuple(to_device(first(x, size), target_device) for x in inputs)
        targets = to_device(first(sample_targets, size), target_device)
        timer = Timer(target_device)
        container.train()
        costs = []
        first_arguments = arguments
        for index, (name, module) in enumerate(layers):
            is_last = index == len(layers) - 1
            measured = _LayerRun(module, arguments, targets if is_last else None, loss_fn, timer)
            costs.append(measured.cost(name, repeats, warmup, optimizer_state_factor))
            arguments = measured.output
        timed, spread = time_in_sequence(
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
        trainable = trainable_parameters(layers)
        version_s = time_weight_version(trainable, timer, repeats, warmup)
    weight_bytes = sum(p.numel() * p.element_size() for p in trainable)
    return Profile(
        costs,
        microbatch_size=size,
        input_bytes=nbytes(inputs, size),
        spread=spread,
        weight_version_byte_s=version_s / weight_bytes if weight_bytes else 0.0,
    )


def _on_model_outputs(loss_fn: LossFn, front: GraphModel) -> LossFn:
    """``loss_fn`` given the last segment's outputs nested as the model returns them."""

    def loss(output: Any, target: Any) -> Tensor:
        return loss_fn(front.outputs(output if isinstance(output, tuple) else (output,)), target)

    return loss


class _LayerRun:
    """One layer measured on fixed inputs: forward, full backward and input-only backward."""

    def __init__(
        self, module: nn.Module, arguments: Values, targets: object, loss_fn: LossFn, timer: Timer
    ) -> None:
        """Measure ``module`` on ``arguments``; ``targets`` (not None) marks the last layer."""
        self.module, self.arguments, self.targets = module, arguments, targets
        self.loss_fn, self.timer = loss_fn, timer
        self.parameters: list[Tensor] = [p for p in module.parameters() if p.requires_grad]
        self.output: Values = ()

    def _forward(self) -> tuple[Values, list[Tensor], float]:
        """Run the layer (and the loss on the last layer); return inputs, roots, seconds."""
        leaves, fed = fresh_inputs(self.arguments)
        start = self.timer.now()
        output = self.module(*fed)
        roots = (
            [self.loss_fn(output, self.targets)] if self.targets is not None else tensors(output)
        )
        elapsed = self.timer.now() - start
        self.output = as_values(output)
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
        forward: list[float] = []
        full: list[float] = []
        inputs_only: list[float] = []
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
        saved_bytes = self._saved_bytes()
        parameter_bytes = nbytes(self.module.parameters())
        trainable_bytes = nbytes(self.parameters)
        activation_bytes = nbytes(self.output)
        return LayerCost(
            forward_s=statistics.median(forward),
            backward_s=backward_s,
            activation_bytes=activation_bytes,
            parameter_bytes=parameter_bytes,
            weight_backward_s=self._weight_share(backward_s, statistics.median(inputs_only)),
            optimizer_bytes=optimizer_state_factor * trainable_bytes,
            peak_memory_bytes=self._peak_memory(activation_bytes + trainable_bytes),
            name=name,
            saved_bytes=saved_bytes,
        )

    def _saved_bytes(self) -> float:
        """Bytes one forward keeps until its backward besides the layer's inputs, weights
        and buffers: the storages autograd saves (the loss's too, on the last layer) and the
        output's, each counted once."""
        kept: dict[int, int] = {}

        def keep(tensor: Tensor) -> Tensor:
            storage = tensor.untyped_storage()
            kept[storage.data_ptr()] = storage.nbytes()
            return tensor

        leaves, fed = fresh_inputs(self.arguments)
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            output = self.module(*fed)
            if self.targets is not None:
                self.loss_fn(output, self.targets)
        for tensor in tensors(output):
            keep(tensor)
        owned = [*tensors(leaves), *tensors(fed), *self.module.parameters()]
        owned += list(self.module.buffers())
        excluded = {tensor.untyped_storage().data_ptr() for tensor in owned}
        return float(sum(size for pointer, size in kept.items() if pointer not in excluded))

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
    positive_int("repeats", repeats)
    non_negative_int("warmup", warmup)
    non_negative_number(
        "optimizer_state_factor (2 for Adam, 1 for SGD with momentum)", optimizer_state_factor
    )


def _microbatch_size(inputs: Values, requested: int | None) -> int:
    """The micro-batch size to profile at: ``requested``, or the sample batch size."""
    tensors = [x for x in inputs if isinstance(x, Tensor) and x.dim() > 0]
    if not tensors:
        raise ValueError("sample_inputs must contain at least one tensor with a batch dimension")
    available = tensors[0].shape[0]
    if requested is None:
        return int(available)
    if not is_int(requested) or not 1 <= requested <= available:
        raise ValueError(
            f"microbatch_size {requested!r} must be an integer between 1 and the sample batch "
            f"size {available}"
        )
    return requested
