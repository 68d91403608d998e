"""One model stage's compute state on this rank: forward, backward and weight passes.

Tensors that enter a stage from another become fresh leaves (floating ones require grad),
so each stage's autograd graph ends at its own inputs; the gradients of those leaves are
what the stage hands back. Everything between a micro-batch's forward and its backward is
kept in the stage's slot for that micro-batch; tensors waiting to be sent (or handed to a
neighbouring stage on this rank) wait in the stage too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipetrain.runtime.rank.batch import LossTarget, Tensors, as_tuple
from pipetrain.runtime.rank.losses import split_loss
from pipetrain.runtime.rank.precision import Precision
from pipetrain.runtime.rank.recompute import RandomState, recompute, recomputes
from pipetrain.runtime.rank.shard import gathered
from pipetrain.runtime.rank.split_backward import WeightPass, input_pass
from pipetrain.runtime.rank.weights import Weights

LossFn = Callable[[Any, Any], Any]
"""``loss_fn(output, target) -> mean loss`` or ``-> (loss_sum, count)``; output and target
are tensors or tuples of them (see :mod:`pipetrain.runtime.rank.losses`)."""

Loss = tuple[torch.Tensor, torch.Tensor | None]
"""A last-stage forward's loss (detached) and, for a pair-returning loss, its count."""


def as_leaves(tensors: Tensors) -> Tensors:
    """Detached copies of boundary tensors; floating ones require grad so that their
    gradient can be sent back."""
    return tuple(
        t.detach().requires_grad_(True) if t.is_floating_point() else t.detach() for t in tensors
    )


@dataclass
class _Slot:
    """What a stage keeps for one micro-batch between its forward and its backward."""

    inputs: Tensors
    outputs: Tensors | None  # None while recomputing (recomputed at the backward)
    version: int | None  # the stash's weight version (asynchronous schedules)
    target: LossTarget | None  # the last stage's, for the loss
    random_state: RandomState | None = None
    loss: torch.Tensor | None = None
    weight_pass: WeightPass | None = None  # set by a split backward


class Stage:
    """Model stage ``index`` on this rank: its passes and the tensors between them.

    ``last`` marks the model's last stage, whose forward computes the loss when given a
    target. ``recompute`` is the recompute mode over ``microbatches`` micro-batches;
    ``split_backward`` makes the backward compute input gradients only, leaving the weight
    gradients to :meth:`weight`. Forwards run under ``precision``'s autocast, the loss is
    taken in float32, and its backward starts from the fp16 loss scale.
    """

    def __init__(
        self,
        index: int,
        weights: Weights,
        loss_fn: LossFn,
        *,
        last: bool,
        recompute: str,
        microbatches: int,
        split_backward: bool,
        precision: Precision | None = None,
        output_of: Callable[[Tensors], Any] | None = None,
    ) -> None:
        """Stage ``index``, whose module and weight versions ``weights`` holds; the last
        stage's outputs reach the loss as ``output_of`` nests them (by default one tensor,
        or a tuple of several)."""
        self.index, self.weights, self.loss_fn, self.last = index, weights, loss_fn, last
        self.output_of = output_of or (lambda tensors: tensors[0] if len(tensors) == 1 else tensors)
        self.precision = precision or Precision("fp32", torch.device("cpu"))
        self.recompute, self.microbatches = recompute, microbatches
        self.split_backward = split_backward
        self.clear()

    def clear(self) -> None:
        """Forget every micro-batch (at the end of a step, or after a failure)."""
        self._slots: dict[int, _Slot] = {}
        self._inputs: dict[int, Tensors] = {}  # arrived, waiting for the forward
        self._outputs: dict[int, Tensors] = {}  # made, waiting to be sent or handed on
        self._output_grads: dict[int, Tensors] = {}  # arrived, waiting for the backward
        self._input_grads: dict[int, Tensors] = {}  # made, waiting to be sent or handed on

    # what arrives and what leaves -----------------------------------------------------
    def give_inputs(self, microbatch: int, tensors: Tensors) -> None:
        """The inputs of ``microbatch`` (the step's data, or the previous stage's outputs)."""
        self._inputs[microbatch] = tensors

    def give_output_grads(self, microbatch: int, tensors: Tensors) -> None:
        """The gradients of ``microbatch``'s outputs, from the next stage."""
        self._output_grads[microbatch] = tensors

    def take_outputs(self, microbatch: int) -> Tensors:
        """``microbatch``'s outputs, detached, for the next stage (or the gathering rank)."""
        return self._outputs.pop(microbatch)

    def take_input_grads(self, microbatch: int) -> Tensors:
        """The gradients of ``microbatch``'s floating inputs, for the previous stage."""
        return self._input_grads.pop(microbatch)

    def remaining_outputs(self) -> dict[int, Tensors]:
        """Outputs nobody took: the last stage's when it had no targets (evaluation) or
        kept them beside the loss."""
        outputs, self._outputs = self._outputs, {}
        return outputs

    def gradient_holders(self, microbatch: int) -> list[torch.Tensor]:
        """The tensors ``microbatch``'s backward accumulates weight gradients in."""
        return self.weights.holders(self.index, self._slots[microbatch].version)

    # passes ---------------------------------------------------------------------------
    def _run(
        self, inputs: Tensors, version: int | None, target: LossTarget | None
    ) -> tuple[Tensors, Loss | None]:
        with self.precision.autocast():
            outputs = as_tuple(self.weights.run(self.index, version, inputs))
            if target is None:
                return outputs, None
            result = self.loss_fn(self.output_of(outputs), target.target)
        loss, count = split_loss(
            result, f"the loss function {_name(self.loss_fn)}", f"on stage {self.index}"
        )
        if count is None:
            return outputs, (loss * target.weight, None)
        # the step's gradients are divided by its weighted count: the weight cancels out
        return outputs, (loss * target.per_value, count.double() * target.per_value)

    def forward(
        self,
        microbatch: int,
        version: int | None,
        target: LossTarget | None,
        keep_outputs: bool = False,
    ) -> Loss | None:
        """Run ``microbatch`` on weight ``version``; return its weighted loss (detached) and
        count if ``target`` is given, else keep its outputs for whoever takes them (with
        ``keep_outputs``, kept beside the loss too, for :meth:`remaining_outputs`)."""
        inputs = self._inputs.pop(microbatch)
        if self.index > 0:
            inputs = as_leaves(inputs)
        if recomputes(self.recompute, microbatch, self.microbatches):
            random_state = RandomState(inputs[0].device if inputs else torch.device("cpu"))
            with torch.no_grad():
                outputs, loss = self._run(inputs, version, target)
            slot = _Slot(inputs, None, version, target, random_state)
        else:
            outputs, loss = self._run(inputs, version, target)
            slot = _Slot(inputs, outputs, version, target)
            slot.loss = None if loss is None else loss[0]
        self._slots[microbatch] = slot
        if loss is None or keep_outputs:
            self._outputs[microbatch] = tuple(t.detach() for t in outputs)
        return None if loss is None else (loss[0].detach(), loss[1])

    def _differentiable(self, microbatch: int, slot: _Slot) -> tuple[Tensors, Tensors]:
        """The tensors to differentiate and their incoming gradients."""
        outputs = slot.outputs
        if outputs is None:
            assert slot.random_state is not None  # kept whenever the outputs were dropped
            outputs, loss = recompute(
                lambda: self._run(slot.inputs, slot.version, slot.target),
                slot.random_state,
                self.weights.modules[self.index],
            )
            slot.outputs, slot.loss = outputs, None if loss is None else loss[0]
        if self.last:
            if slot.loss is None:
                raise RuntimeError(f"stage {self.index} has no loss to differentiate: no targets")
            return (slot.loss,), (self.precision.loss_grad(slot.loss),)
        grads = self._output_grads.pop(microbatch)
        floating = [t for t in outputs if t.is_floating_point()]
        pairs = [(t, g) for t, g in zip(floating, grads) if t.requires_grad]
        return tuple(t for t, _ in pairs), tuple(g for _, g in pairs)

    def backward(self, microbatch: int, whole: bool = False) -> None:
        """Differentiate ``microbatch``: input gradients, and weight gradients too unless the
        backward is split; ``whole`` runs a split stage's backward in one pass, its W then
        having nothing left to do."""
        slot = self._slots[microbatch]
        tensors, grads = self._differentiable(microbatch, slot)
        leaves = [t for t in slot.inputs if t.requires_grad]
        input_grads: tuple[torch.Tensor | None, ...]
        if self.split_backward and not whole:
            # input gradients only; the weight gradients follow in W from what this keeps
            parameters = gathered(self.weights.modules[self.index]) or self.gradient_holders(
                microbatch
            )
            input_grads, slot.weight_pass = input_pass(tensors, grads, leaves, parameters)
            slot.outputs, slot.loss = (), None  # frees the graph above what W needs
        else:
            if tensors:
                torch.autograd.backward(tensors, grads)
            input_grads = tuple(t.grad for t in leaves)
            del self._slots[microbatch]
        if self.index > 0:
            by_leaf = dict(zip(map(id, leaves), input_grads))
            self._input_grads[microbatch] = tuple(
                _or_zeros(by_leaf.get(id(t)), t) for t in slot.inputs if t.is_floating_point()
            )

    def weight(self, microbatch: int) -> None:
        """The weight gradients of a split backward, from what its input pass kept (for a
        sharded stage, into the gathered parameters its forward ran on)."""
        weight_pass = self._slots.pop(microbatch).weight_pass
        assert weight_pass is not None, f"W of micro-batch {microbatch} before its B"
        weight_pass.run()


def _name(fn: LossFn) -> str:
    name = getattr(fn, "__name__", None)
    return repr(name) if isinstance(name, str) else repr(fn)


def _or_zeros(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return grad if grad is not None else torch.zeros_like(like)
