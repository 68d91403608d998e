"""A step's data on one rank, split into micro-batches.

The batch is split with :func:`torch.tensor_split`, so a batch that the micro-batch count
does not divide is fine; or it comes already split, as :class:`MicroBatches` whose shapes
may differ (sequences padded each micro-batch to its own longest). Each micro-batch's
loss is weighted by its share of the samples of the update it belongs to (``size_k /
update``), which makes the summed loss of an update the mean over its samples, as the
unpipelined model computes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from pipetrain.schedules import Schedule

Tensors = tuple[torch.Tensor, ...]
Target = torch.Tensor | Tensors


class MicroBatches(tuple[Any, ...]):
    """A step's inputs or targets given micro-batch by micro-batch: each piece a tensor or
    a tuple of tensors, as the whole batch would be, and their shapes may differ from one
    piece to the next (beyond the first dimension too: a sequence length, say). Give the
    inputs and the targets the same way, one piece for each micro-batch of the step."""

    def __new__(cls, pieces: Sequence[torch.Tensor | Sequence[torch.Tensor]]) -> MicroBatches:
        """The step's ``pieces``, in micro-batch order."""
        if not pieces:
            raise ValueError("MicroBatches needs at least one micro-batch")
        return super().__new__(cls, pieces)

    @property
    def pieces(self) -> tuple[Any, ...]:
        """The micro-batches, in order."""
        return tuple(self)


Data = torch.Tensor | Sequence[torch.Tensor]


def as_tuple(value: torch.Tensor | Sequence[torch.Tensor]) -> Tensors:
    """A tensor, or a sequence of tensors, as a tuple of tensors."""
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)


def batch_size(value: Data, what: str) -> int:
    """The size of ``value``'s first dimension (of its first tensor, for a tuple; summed
    over the pieces of :class:`MicroBatches`)."""
    if isinstance(value, MicroBatches):
        return sum(batch_size(piece, what) for piece in value.pieces)
    tensor = value if isinstance(value, torch.Tensor) else value[0]
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        raise TypeError(
            f"{what} must be a tensor (or tuple of tensors) with a batch dimension, "
            f"got {type(tensor).__name__}"
        )
    return tensor.shape[0]


def _split(value: Data, parts: int, device: torch.device, what: str) -> list[Target]:
    """``value`` split into ``parts`` pieces along dim 0, each moved to ``device``."""
    if isinstance(value, MicroBatches):
        if len(value) != parts:
            raise ValueError(
                f"{what} come as {len(value)} micro-batches but the step plays {parts}; "
                f"give {parts} pieces"
            )
        return [_moved(piece, device) for piece in value.pieces]
    size = batch_size(value, what)
    if size < parts:
        raise ValueError(
            f"batch of {size} samples is smaller than microbatches={parts}; "
            "use a larger batch or fewer micro-batches"
        )
    if isinstance(value, torch.Tensor):
        return [piece.to(device) for piece in torch.tensor_split(value, parts)]
    pieces = [torch.tensor_split(t, parts) for t in value]
    return [tuple(p[i].to(device) for p in pieces) for i in range(parts)]


def _moved(piece: torch.Tensor | Sequence[torch.Tensor], device: torch.device) -> Target:
    if isinstance(piece, torch.Tensor):
        return piece.to(device)
    return tuple(t.to(device) for t in piece)


class LossTarget(NamedTuple):
    """What a last-stage forward computes its loss against, and the loss's weight."""

    target: Target
    weight: float
    # a (loss_sum, count) pair's weight, the same for every micro-batch of the update: one
    # over its target values, so that gradients keep a mean's magnitude (fp16 overflows no
    # sooner than the unpipelined mean); the division by the weighted count undoes it
    per_value: float = 1.0


class StepData:
    """What one step reads on this rank.

    The first stage's ranks get the micro-batch inputs (:meth:`set_inputs`); the last
    stage's ranks get the targets (:meth:`set_targets`, or from a ``RECV_T``), split into
    micro-batches with their loss weights; a rank that ships the targets keeps the whole
    batch's for its ``SEND_T`` (:meth:`set_shipped`). ``per_update`` micro-batches make one
    update (all of them for synchronous schedules). With ``keep_outputs`` the last stage
    keeps its outputs beside the loss.
    """

    def __init__(self, microbatches: int, per_update: int, device: torch.device) -> None:
        """Data for ``microbatches`` micro-batches, placed on ``device``."""
        self.microbatches, self.per_update, self.device = microbatches, per_update, device
        self.inputs: list[Tensors] | None = None
        self.shipped: Tensors | None = None
        self.targets: list[LossTarget] | None = None
        self.keep_outputs = False

    @classmethod
    def for_rank(
        cls,
        schedule: Schedule,
        rank: int,
        inputs: Data | None,
        targets: Data | None,
        *,
        training: bool,
        ships_targets: bool,
        per_update: int,
        device: torch.device,
    ) -> StepData:
        """What ``rank`` reads of a step of ``schedule``: the inputs if it holds the first
        stage; when ``training``, the targets if it holds the last stage, or, with
        ``ships_targets``, if it is the first input-stage rank (which sends them on to the
        last-stage ranks that do not hold the first stage; one that does reads its own).
        ValueError names a missing one."""
        data = cls(schedule.microbatches, per_update, device)
        held = schedule.stages_of(rank)
        if 0 in held:
            if inputs is None:
                raise ValueError(
                    f"rank {rank} holds the first stage and needs the inputs; got None"
                )
            data.set_inputs(inputs)
        if not training:
            return data
        source = schedule.stage_ranks[0][0]
        if ships_targets and rank == source:
            if targets is None:
                raise ValueError(
                    f"rank {rank} holds the first stage and, with targets_on_first_stage, "
                    "needs the targets; got None"
                )
            data.set_shipped(targets)
        if schedule.stages - 1 in held and not (ships_targets and 0 not in held):
            if targets is None:
                raise ValueError(
                    f"rank {rank} holds the last stage and needs the targets; got None"
                )
            data.set_targets(targets)
        return data

    def set_inputs(self, inputs: Data) -> None:
        """Split the first stage's inputs into micro-batches."""
        pieces = _split(inputs, self.microbatches, self.device, "inputs")
        self.inputs = [as_tuple(p) for p in pieces]

    def set_shipped(self, targets: Data) -> None:
        """Keep the whole batch's targets for sending to the last stage."""
        if isinstance(targets, MicroBatches):
            raise ValueError(
                "targets_on_first_stage ships the step's targets as one tensor, so they "
                "cannot come as MicroBatches; give the last stage's ranks the targets instead"
            )
        self.shipped = tuple(t.to(self.device) for t in as_tuple(targets))

    def set_targets(self, targets: Data) -> None:
        """Split the last stage's targets into micro-batches and weigh each one's loss."""
        pieces = _split(targets, self.microbatches, self.device, "targets")
        sizes = [batch_size(piece, "targets") for piece in pieces]
        values = [as_tuple(piece)[0].numel() for piece in pieces]
        self.targets = [
            LossTarget(piece, size / update, 1 / max(update_values, 1))
            for piece, size, update, update_values in zip(
                pieces, sizes, self._per_update(sizes), self._per_update(values)
            )
        ]

    def _per_update(self, amounts: list[int]) -> list[int]:
        """For each micro-batch, the sum of ``amounts`` over the update it belongs to."""
        per = self.per_update
        return [sum(amounts[k - k % per : k - k % per + per]) for k in range(len(amounts))]

    def receive_targets(self, tensors: Tensors) -> None:
        """Targets that arrived as a message: one tensor travels as a tuple of one."""
        self.set_targets(tensors[0] if len(tensors) == 1 else tensors)

    def loss_target(self, microbatch: int) -> LossTarget | None:
        """The target of a last-stage micro-batch; ``None`` without targets (evaluation)."""
        return None if self.targets is None else self.targets[microbatch]
