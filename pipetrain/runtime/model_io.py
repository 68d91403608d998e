"""A step's data between the user's model and the pipeline: :class:`ModelIO`.

The user gives inputs as the model takes them (a tensor, a tuple, or a captured model's
dict of keyword inputs) and receives outputs as the model returns them; the stages pass
flat tuples of tensors. A captured model trained on its own loss (``output.loss``, as
Hugging Face models compute it from labels among the inputs) needs no targets: a stand-in
of the batch's size weighs each micro-batch's loss by its share of the samples; evaluated,
it returns its outputs with the loss when given the labels, without them otherwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pipetrain.distributed.transport import Transport
from pipetrain.model.capture import Inputs
from pipetrain.model.frontend import FrontEnd
from pipetrain.model.graph import GraphModel
from pipetrain.runtime.rank.batch import Data, MicroBatches
from pipetrain.runtime.rank.stage import LossFn
from pipetrain.runtime.steps import Outputs
from pipetrain.runtime.token_budget import Sequences
from pipetrain.schedules import Schedule


def model_loss(output: Any, target: Any) -> torch.Tensor:
    """The loss a model computes itself (``output.loss``, as Hugging Face models do)."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            f"the model returned a {type(output).__name__} without a loss: give the labels "
            "among the inputs (labels=...), or pass loss_fn=(output, target) -> loss"
        )
    return loss


def loss_function(loss_fn: LossFn | None, front: FrontEnd) -> tuple[LossFn, bool]:
    """The loss function to train with, and whether it is a captured model's own loss."""
    if loss_fn is None and isinstance(front, GraphModel):
        return model_loss, True
    if loss_fn is None or not callable(loss_fn):
        raise TypeError(f"loss_fn must be a callable (output, target) -> loss, got {loss_fn!r}")
    return loss_fn, False


class ModelIO:
    """Turns a step's inputs into the first stage's tensors and the last stage's tensors
    into the model's outputs, for ``front``; ``own_loss`` when the model's own loss is
    trained; this is rank ``rank`` of ``schedule``, reaching the others by ``transport``."""

    def __init__(
        self, front: FrontEnd, own_loss: bool, rank: int, schedule: Schedule, transport: Transport
    ) -> None:
        """Translate for ``front``."""
        self.front, self.own_loss, self.transport = front, own_loss, transport
        last = schedule.stages - 1 in schedule.stages_of(rank)
        self.last_rank = rank if last else None
        self.chooses = rank == schedule.stage_ranks[0][0]  # the inputs evaluated

    def inputs(self, inputs: Inputs | None) -> Data | None:
        """A step's inputs as the first stage takes them: micro-batches given one by one
        each so, rows of their own lengths as they are (formed into micro-batches later)."""
        if inputs is None or isinstance(inputs, Sequences):
            return inputs
        if isinstance(inputs, MicroBatches):
            return MicroBatches([self.front.inputs(piece) for piece in inputs.pieces])
        return self.front.inputs(inputs)

    def evaluation_inputs(self, inputs: Inputs | None) -> Data | None:
        """An evaluation's inputs as the first stage takes them. A captured model trained
        on its own loss may be evaluated without its labels: the first stage's first rank
        tells every rank which inputs it was given (every rank calls this), and the stages
        run the model's eval mode on those."""
        front = self.front
        if not (self.own_loss and isinstance(front, GraphModel) and front.captured.keyword):
            return self.inputs(inputs)
        names: tuple[str, ...] = ()
        flat = None
        if inputs is not None:
            names, flat = front.evaluation_inputs(inputs)
        captured = front.captured.input_names
        given = torch.tensor(
            [self.chooses and name in names for name in captured],
            dtype=torch.int64,
            device=self.transport.device,
        )
        self.transport.all_reduce(given)  # only the first stage's first rank counts
        front.evaluated = tuple(n for n, g in zip(captured, given.tolist(), strict=True) if g)
        return flat

    def outputs(self, outputs: Outputs | None, evaluation: bool = False) -> Any:
        """Gathered outputs nested as the model returns them (``evaluation``: as its eval
        mode does on the inputs evaluated)."""
        if outputs is None:
            return None
        tensors = (outputs,) if isinstance(outputs, torch.Tensor) else outputs
        if isinstance(self.front, GraphModel):
            return self.front.outputs(tensors, evaluation)
        return self.front.outputs(tensors)

    def step_data(self, inputs: Inputs | None, targets: Data | None) -> tuple[Any, Any]:
        """A step's inputs as the first stage takes them, and its targets: with the
        model's own loss, a stand-in of the batch's size that weighs each micro-batch."""
        flat = self.inputs(inputs)
        if not self.own_loss or targets is not None:
            return flat, targets
        if flat is None:
            if self.last_rank is not None:
                raise ValueError(
                    f"rank {self.last_rank} holds the last stage, which takes the model's own "
                    "loss and needs the inputs too (their batch size weighs each micro-batch)"
                )
            return None, None
        return flat, torch.zeros(len(flat[0]))


@contextlib.contextmanager
def evaluating(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Every module of ``modules`` (and every submodule) in eval mode for the block, each
    put back in its own mode afterwards, also when the block raises."""
    modules = list(modules)
    modes = [(m, m.training) for module in modules for m in module.modules()]
    try:
        for module in modules:
            module.eval()
        yield
    finally:
        for layer, training in modes:
            layer.training = training
