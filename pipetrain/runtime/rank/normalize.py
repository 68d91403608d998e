"""Normalization of ``(loss_sum, count)`` losses: a step's gradients divided by its count.

When the loss function returns ``(loss_sum, count)`` (see :mod:`pipetrain.runtime.rank.losses`),
each micro-batch's backward starts from its ``loss_sum`` (times the fp16 loss scale), sum
and count both weighted by one weight shared by the whole update (see
:class:`~pipetrain.runtime.rank.batch.LossTarget`). Gradients are linear in the loss, so
dividing everything a step produced by the step's total weighted count gives exactly the
gradients of ``Σ loss_sum / Σ count`` on the whole batch.
The total is known only once every last-stage forward ran, on whichever rank: at each
rank's last ``STEP`` of a synchronous step, before any clipping or update, the update's
statistics all-reduce sums the rank's counts and how many of its micro-batches returned a
pair, and the division follows it (the gradients' norm, taken before, is divided too);
where the update cannot (no update, or gradients put aside whose norm is not yet known),
an all-reduce of those two numbers of its own does. A pipeline whose first step returned
no pair never asks again; a later pair is refused at the loss all-reduce.

Gradients accumulated by earlier ``train_step(update=False)`` calls are put aside for the
step (:meth:`Normalizer.set_aside`) and added back after the division, so only the step's
own contribution is divided. A replicated stage's replicas all-reduce only the step's own
gradients at an update; what they had put aside is all-reduced then too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from pipetrain.runtime.rank.reduce import Reducer


class Normalizer:
    """Divides one rank's gradients by each step's total count, for pair-returning losses.

    ``holders`` are the gradient holders of each stage the rank holds, ``reducers`` the
    replicated stages' gradient reducers, ``all_reduce`` sums a tensor over every rank.
    """

    def __init__(
        self,
        holders: Mapping[int, Sequence[torch.Tensor]],
        reducers: Mapping[int, Reducer],
        all_reduce: Callable[[torch.Tensor], None],
        device: torch.device,
    ) -> None:
        """Normalize the gradients of ``holders``' tensors."""
        # a tensor two of the rank's stages use (a tied weight held by both ends of a V
        # schedule) accumulates one gradient: it is divided once, with its first stage
        seen: set[int] = set()
        self.holders: dict[int, list[torch.Tensor]] = {}
        for stage, tensors in holders.items():
            self.holders[stage] = [t for t in tensors if id(t) not in seen]
            seen.update(id(t) for t in tensors)
        self.reducers, self.all_reduce, self.device = reducers, all_reduce, device
        self.normalizing: bool | None = None  # unknown until a step has run its loss
        self._aside: dict[int, list[torch.Tensor | None]] = {}

    def set_aside(self) -> None:
        """Before a step that adds to accumulated gradients: take them off the tensors
        (pair losses only), to add back once the step's own are divided."""
        if not self.normalizing:
            return
        for stage, tensors in self.holders.items():
            self._aside[stage] = [t.grad for t in tensors]
            for tensor in tensors:
                tensor.grad = None

    def finish(self, count: torch.Tensor, pairs: int, microbatches: int, updating: bool) -> None:
        """After this rank's last backward of a step: learn the step's total count and
        divide the step's gradients by it, then add back what was put aside (all-reduced
        over a replicated stage's replicas first when ``updating``). ``count`` and
        ``pairs`` are this rank's counts and pair-returning micro-batches of
        ``microbatches``. Every rank calls it at the same point of the step."""
        if self.normalizing is False:
            return
        pairs_held = torch.tensor(float(pairs), dtype=torch.float64, device=count.device)
        stats = torch.stack([count.double(), pairs_held]).to(self.device)
        self.all_reduce(stats)
        self.divide(stats[0], round(float(stats[1])), microbatches, updating)

    @property
    def holds_aside(self) -> bool:
        """Whether gradients of earlier steps are put aside, to be added back after the
        division (the gradients' norm is then known only once they are)."""
        return bool(self._aside)

    def divide(
        self, total: torch.Tensor, returned: int, microbatches: int, updating: bool
    ) -> float:
        """:meth:`finish` once the step's ``total`` count and ``returned`` pair-returning
        micro-batches are summed over every rank (by an update's statistics all-reduce,
        say); return the divisor applied (1.0 for scalar losses)."""
        check_kinds(returned, microbatches, self.normalizing)
        self.normalizing = returned > 0
        if not self.normalizing:
            return 1.0
        for stage, tensors in self.holders.items():
            for tensor in tensors:
                if tensor.grad is not None:
                    tensor.grad.div_(total)
            aside = self._aside.pop(stage, None)
            if aside is not None:
                self._add_back(stage, tensors, aside, updating)
        return float(total)

    def _add_back(
        self,
        stage: int,
        tensors: list[torch.Tensor],
        aside: list[torch.Tensor | None],
        updating: bool,
    ) -> None:
        reducer = self.reducers.get(stage) if updating else None
        if reducer is not None:
            # replicas accumulated locally; their update sums what each put aside too
            own = [t.grad for t in tensors]
            for tensor, grad in zip(tensors, aside):
                tensor.grad = grad if grad is not None else torch.zeros_like(tensor)
            reducer.finish(tensors)
            aside = [t.grad for t in tensors]
            for tensor, grad in zip(tensors, own):
                tensor.grad = grad
        for tensor, grad in zip(tensors, aside):
            if grad is not None:
                tensor.grad = grad if tensor.grad is None else tensor.grad.add_(grad)


def check_kinds(pairs: int, microbatches: int, normalizing: bool | None) -> None:
    """Raise ValueError unless the step's ``pairs`` pair-returning micro-batches (of
    ``microbatches``) agree with one another and with the earlier steps (``normalizing``:
    whether they returned pairs; ``None`` before the first step)."""
    if 0 < pairs < microbatches:
        raise ValueError(
            f"the loss function returned (loss_sum, count) for {pairs} of {microbatches} "
            "micro-batches and a scalar for the others; return one kind for every micro-batch"
        )
    if normalizing is not None and normalizing != (pairs > 0):
        earlier, now = ("(loss_sum, count)", "a scalar") if normalizing else ("a scalar", "a pair")
        raise ValueError(
            f"the loss function returned {now} after returning {earlier} in earlier steps; "
            "return the same kind in every step of a pipeline"
        )
