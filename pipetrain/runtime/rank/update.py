"""What an update does around the optimizer's step on one rank: the global gradient norm,
clipping, the finiteness check with its policy, and the learning-rate schedule.

A synchronous update happens on every rank at its last ``STEP``: one all-reduce of this
rank's squared gradient norm and its share of the step's loss (with whatever else the
caller's loss statistics carry, kept summed for :meth:`Updater.take_reduced_loss`, so that
the step's reported loss needs no all-reduce of its own) gives every rank the same global
norm and loss, so every rank takes the same decision: clip, step, or refuse the update.
A replicated stage's gradients count once, on its first replica (the replicas hold equal
gradients after their all-reduce); a stage without parameters contributes nothing.
Asynchronous schedules update each stage on its own, so their check is local: a
non-finite gradient raises before that stage's update. With clipping they defer each
update instead (:meth:`Updater.defer`): its gradients are put aside and an all-reduce of
their squared norm starts at once; the update is applied, clipped by that
global norm, when a forward first needs its weights or at the end of the window, so it
waits for the input stage's backward only where the schedule's versions already do
(every stage running each micro-batch on the same version). Under fp16 the
gradients are unscaled first and the all-reduce also carries whether any rank's
gradients overflowed: then every rank skips the update and backs its loss scale off, as
:class:`torch.amp.GradScaler` does (see :mod:`pipetrain.runtime.rank.precision`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pipetrain.runtime.rank.precision import Precision
from pipetrain.runtime.rank.shard import local
from pipetrain.runtime.rank.update_config import LRSchedulerFactory, check_policy


class NonFiniteError(RuntimeError):
    """An update met a non-finite loss or gradient norm and was not applied."""


@dataclass
class PendingUpdate:
    """An asynchronous stage's update put aside until its global norm is known."""

    grads: list[torch.Tensor | None]  # in the order of the stage's parameters
    square: torch.Tensor  # this rank's squared norm, summed over every rank once waited
    wait: Callable[[], None]


def _clip(parameters: Sequence[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients of ``parameters`` (each shard of a sharded one, in place) so that
    their global ``norm`` is at most ``max_norm``, with :func:`clip_grads_with_norm_`'s
    arithmetic."""
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for grad in (local(p.grad) for p in parameters if p.grad is not None):
        grad.mul_(coefficient.to(grad.device))


def _step(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()


def _square_norm(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The squared 2-norm of ``tensors`` taken together, in float32 (0 for none)."""
    if not tensors:
        return torch.zeros((), device=device)
    norms = torch._foreach_norm(list(tensors))
    return torch.stack([n.float() for n in norms]).square().sum().to(device)


class Updater:
    """Applies this rank's updates.

    ``active`` says whether the pipeline updates at all (the same on every rank; a rank
    whose stages have no parameters is active with ``optimizer=None``: it takes part in
    every update's all-reduce and counts the updates). ``parameters`` are this rank's
    trainable parameters; ``counted`` those whose gradients enter the global norm here.
    ``all_reduce`` sums a tensor over every rank (``None``: this rank is the whole group).
    ``reduce_shared`` sums the parts of parameters several stages share, once per update,
    before anything reads the gradients; ``count_shared_once`` keeps each such sum on one
    holder, before more gradients are added to it. ``step_optimizer`` makes a synchronous
    update's optimizer step (by default ``optimizer.step()``; a host store steps it stage by
    stage).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | None,
        *,
        active: bool | None = None,
        parameters: Sequence[torch.Tensor] | None = None,
        counted: Sequence[torch.Tensor] | None = None,
        all_reduce: Callable[[torch.Tensor], None] | None = None,
        all_reduce_start: Callable[[torch.Tensor], Callable[[], None]] | None = None,
        device: torch.device | str = "cpu",
        max_grad_norm: float | None = None,
        on_nonfinite: str = "raise",
        lr_scheduler: LRSchedulerFactory | None = None,
        precision: Precision | None = None,
        reduce_shared: Callable[[], None] | None = None,
        count_shared_once: Callable[[], None] | None = None,
        step_optimizer: Callable[[torch.optim.Optimizer], None] | None = None,
    ) -> None:
        """Step ``optimizer`` at each update, under the given policies."""
        check_policy(max_grad_norm, on_nonfinite)
        self.optimizer = optimizer
        self.active = optimizer is not None if active is None else active
        if parameters is None:
            groups = optimizer.param_groups if optimizer is not None else []
            parameters = [p for group in groups for p in group["params"]]
        self.parameters = list(parameters)
        self.counted = list(self.parameters if counted is None else counted)
        self.all_reduce = all_reduce
        self.all_reduce_start = all_reduce_start
        self.reduce_shared, self.count_shared_once = reduce_shared, count_shared_once
        self.step_optimizer = step_optimizer or _step
        self._shared = False
        self.device = torch.device(device)
        self.max_grad_norm, self.on_nonfinite = max_grad_norm, on_nonfinite
        self.lr_scheduler = (
            lr_scheduler(optimizer) if lr_scheduler is not None and optimizer is not None else None
        )
        self.precision = precision or Precision("fp32", self.device)
        self._found_inf: torch.Tensor | None = None  # set once this update's grads are unscaled
        self._reduced_loss: torch.Tensor | None = None
        self.updates = 0  # applied
        self.skipped_updates = 0

    def _grads(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # a sharded parameter's norm is of this rank's shard: the shards' squares add up
        return [local(t.grad) for t in tensors if t.grad is not None]

    def start(self) -> None:
        """Forget the unscaling (and sharing) of gradients cleared for a new update."""
        self._found_inf = None
        self._shared = False

    def reopen(self) -> None:
        """Before a call adds gradients to this update's, which a clip may have prepared
        already (unscaled, the shared parameters' parts summed): scale them back and keep
        each shared sum on one holder, so that the update unscales and sums every call's
        gradients once."""
        if self._found_inf is not None and self.precision.scales_loss:
            scale = self.precision.scale
            for grad in self._grads(self.parameters):
                grad.mul_(scale)  # exact for the usual powers of two
        if self._shared and self.count_shared_once is not None:
            self.count_shared_once()
        self.start()

    def _unscaled(self) -> torch.Tensor:
        """Unscale this update's gradients once (fp16); whether they overflowed here."""
        if self._found_inf is None:
            self._found_inf = self.precision.unscale_(self.parameters)
        return self._found_inf

    def _share(self) -> None:
        """Sum the shared parameters' parts, once per update, before anything reads them."""
        if not self._shared and self.reduce_shared is not None:
            self.reduce_shared()
            self._shared = True

    def _reduced(self, loss: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The global gradient norm (a tensor), the loss statistics and whether any rank's
        gradients overflowed, over every rank; ``loss`` is this rank's loss statistics
        (the loss first), summed over every rank in the same all-reduce."""
        local = torch.zeros(1, device=self.device) if loss is None else loss.reshape(-1)
        self._share()
        overflowed = self._unscaled().to(self.device)  # before the norm: it is of unscaled grads
        square = _square_norm(self._grads(self.counted), self.device)
        # float64, so that counts carried with the loss stay exact
        stats = torch.cat([torch.stack([square, overflowed]).double(), local.double()])
        if self.all_reduce is not None:
            self.all_reduce(stats)
        return stats[0].sqrt().float(), stats[2:].to(local.dtype), bool(stats[1] > 0)

    def take_reduced_loss(self) -> torch.Tensor | None:
        """The loss statistics the last :meth:`apply` summed over every rank (``None`` if no
        update all-reduced them since the last call)."""
        reduced, self._reduced_loss = self._reduced_loss, None
        return reduced

    def global_norm(self) -> torch.Tensor:
        """The 2-norm of every rank's (unscaled) gradients taken together (every rank must
        call it)."""
        return self._reduced(None)[0]

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale this rank's gradients so that the global norm is at most ``max_norm``, as
        :func:`torch.nn.utils.clip_grad_norm_` on the whole model; return the norm before."""
        norm = self.global_norm()
        _clip(self.parameters, max_norm, norm)
        return float(norm)

    def apply(
        self,
        loss: torch.Tensor | None,
        normalize: Callable[[torch.Tensor], float] | None = None,
    ) -> None:
        """A synchronous update on every rank: check that ``loss`` (this rank's share of the
        step's loss, or a vector of loss statistics with the loss first, the same length on
        every rank) and the global gradient norm are finite, clip, and step. Under fp16 an
        overflow of finite-loss gradients skips the update and backs the scale off.
        ``normalize``, given the summed loss statistics, divides every gradient by what it
        returns before anything but the norm reads them (the norm is divided alike)."""
        if not self.active:
            self._share()  # the gradients are the result: they must be the model's
            return
        norm, reduced_loss, overflowed = self._reduced(loss)
        if normalize is not None:
            norm = norm / normalize(reduced_loss)
        total_loss = float(reduced_loss[0])
        if self.all_reduce is not None:  # else the sum is this rank's alone
            self._reduced_loss = reduced_loss
        self._found_inf = None
        if not math.isfinite(total_loss) or not (overflowed or math.isfinite(float(norm))):
            self.precision.update(overflowed)
            self._refuse(f"loss {total_loss}, gradient norm {float(norm)}")
            return
        self.precision.update(overflowed)
        if overflowed:
            self._clear()
            return
        if self.max_grad_norm is not None:
            _clip(self.parameters, self.max_grad_norm, norm)
        if self.optimizer is not None:
            self.step_optimizer(self.optimizer)
        self.finish()

    def step_local(self, tensors: Sequence[torch.Tensor], stage: int) -> None:
        """An asynchronous stage's update: refuse it if its gradients are not finite, else
        step the optimizer (the scheduler steps in :meth:`finish`)."""
        norm = _square_norm(self._grads(tensors), self.device)
        if not math.isfinite(float(norm)):
            raise NonFiniteError(
                f"stage {stage}'s gradients are not finite; its update was not applied"
            )
        if self.optimizer is not None:
            self.optimizer.step()

    @property
    def defers(self) -> bool:
        """Whether asynchronous updates wait for their global norm (to clip by it)."""
        return self.max_grad_norm is not None

    def defer(self, parameters: Sequence[torch.Tensor]) -> PendingUpdate:
        """Put an asynchronous stage's update aside: take its gradients off ``parameters``
        and start the all-reduce of their squared norm."""
        grads = [p.grad for p in parameters]
        for parameter in parameters:
            parameter.grad = None
        square = _square_norm([g for g in grads if g is not None], self.device).reshape(1)
        if self.all_reduce_start is not None:
            return PendingUpdate(grads, square, self.all_reduce_start(square))
        if self.all_reduce is not None:
            self.all_reduce(square)
        return PendingUpdate(grads, square, lambda: None)

    def apply_deferred(
        self, pending: PendingUpdate, parameters: Sequence[torch.Tensor], stage: int
    ) -> None:
        """Apply an update :meth:`defer` put aside: clipped by the global norm, or refused
        (:class:`NonFiniteError`) if that norm is not finite."""
        pending.wait()
        norm = pending.square[0].sqrt()
        if not math.isfinite(float(norm)):
            raise NonFiniteError(
                f"stage {stage}'s update {self.updates + 1}: the global gradient norm is "
                f"{float(norm)}; the update was not applied"
            )
        for parameter, grad in zip(parameters, pending.grads):
            parameter.grad = grad
        assert self.max_grad_norm is not None  # only clipping defers
        _clip(parameters, self.max_grad_norm, norm)
        if self.optimizer is not None:
            self.optimizer.step()

    def finish(self) -> None:
        """Count an applied update and step the learning-rate schedule."""
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.updates += 1

    def _refuse(self, found: str) -> None:
        message = f"non-finite values at update {self.updates + self.skipped_updates + 1}: {found}"
        if self.on_nonfinite == "raise":
            raise NonFiniteError(f"{message}; the update was not applied")
        if self.on_nonfinite == "warn":
            warnings.warn(f"{message}; update skipped", RuntimeWarning, stacklevel=2)
        self._clear()

    def _clear(self) -> None:
        """Drop a skipped update's gradients."""
        for parameter in self.parameters:
            parameter.grad = None
        self.skipped_updates += 1
