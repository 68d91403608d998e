"""The update cycle of one rank, and its one owner: :class:`UpdateCycle`.

A training call runs micro-batches whose losses and gradients make updates. The cycle
keeps everything about that between the executor's actions and across calls:

- **accumulation**: a call that does not update (``train_step(update=False)``) leaves its
  gradients for the next; the next call adds to them, and :meth:`UpdateCycle.apply_accumulated`
  applies them without another call;
- **the loss**: the last stage's forwards add their losses (and, for ``(loss_sum, count)``
  losses, their counts); ``LOSS`` gives the step's loss, summed over every rank, as the
  mean over its updates;
- **normalization**: the gradients of ``(loss_sum, count)`` losses are divided by the step's
  count (see :mod:`~pipetrain.runtime.rank.normalize`), inside the update's own all-reduce
  where it can;
- **the update**: ``STEP`` hands the stage to the weights, which apply it when every held
  stage has stepped (synchronous) or at once (asynchronous) under the
  :class:`~pipetrain.runtime.rank.update.Updater`'s policies; ``ALLREDUCE`` finishes a
  replicated stage's gradient all-reduce, which the update's last gradient pass started,
  and ``GATHER`` all-gathers a sharded stage's parameters;
- **the host store** (a schedule with ``LOAD`` and ``OFFLOAD``): ``LOAD`` and ``OFFLOAD``
  go to the :class:`~pipetrain.runtime.rank.stored_stage.HostWeights`, and a stage's last
  ``OFFLOAD`` of a run that returns gradients is its ``STEP`` (a stale store's: a step late);
- **the counters**: updates applied and skipped, restored from a checkpoint.

The executor only dispatches: its ``STEP``, ``LOSS``, ``ALLREDUCE``, ``GATHER``, ``LOAD`` and
``OFFLOAD`` handlers each make one call here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from pipetrain.runtime.rank.normalize import Normalizer, check_kinds
from pipetrain.runtime.rank.precision import Precision
from pipetrain.runtime.rank.reduce import Reducer, completing_passes
from pipetrain.runtime.rank.stage import Loss, Stage
from pipetrain.runtime.rank.stored_stage import HostWeights
from pipetrain.runtime.rank.weights import Weights
from pipetrain.schedules import Action, Kind, Schedule
from pipetrain.schedules.residency import stepping_offloads


class UpdateCycle:
    """Accumulation, the step's loss, normalization, updates and their counters on one rank.

    ``weights`` holds this rank's stages and applies their updates; ``reducers`` all-reduce
    the gradients of its replicated stages; ``all_reduce`` sums a tensor over every rank;
    ``per_update`` counts the micro-batches of one update (by default every micro-batch of
    a run), which turns a run's summed loss into the mean over its updates. A ``mirror``
    (a tensor-parallel process other than its rank's first) computes the same losses as
    the first, which alone counts them. ``host`` holds the stages whose weights live in
    the host store.
    """

    def __init__(
        self,
        weights: Weights,
        reducers: Mapping[int, Reducer],
        all_reduce: Callable[[torch.Tensor], None],
        device: torch.device,
        per_update: int | None = None,
        mirror: bool = False,
        host: HostWeights | None = None,
    ) -> None:
        """Own the update cycle of ``weights``' stages."""
        self._mirror, self._host = mirror, host
        self._stepping: dict[int, int] = {}  # stage -> its OFFLOAD that is its STEP
        self._offloads: dict[int, int] = {}
        self._weights, self._updater = weights, weights.updater
        self._reducers = dict(reducers)
        self._all_reduce, self._device, self._per_update = all_reduce, device, per_update
        holders = {stage: weights.holders(stage, None) for stage in weights.modules}
        self._normalizer = Normalizer(holders, self._reducers, all_reduce, device)
        self._accumulated = False  # gradients of non-updating calls wait for an update
        self._reduced = False  # ... already reduced over the replicas (for a clip)
        self._schedule: Schedule | None = None
        self._arming: set[tuple[int, int]] = set()

    # between calls ----------------------------------------------------------------------
    def start_call(self, update: bool) -> None:
        """Before a training call: clear the gradients of the last update, or put the
        accumulated ones aside so that only this call's are divided by its count; with
        ``update=False`` this call's gradients will wait for a later update."""
        if not self._accumulated:
            self._clear_gradients()
            self._updater.start()
        else:
            if self._reduced:  # a clip reduced them: the next reduction must count them once
                for stage, reducer in self._reducers.items():
                    reducer.count_once(self._weights.holders(stage, None))
            self._updater.reopen()
            self._normalizer.set_aside()
        self._accumulated, self._reduced = not update, False

    def apply_accumulated(self) -> None:
        """Apply the gradients that non-updating calls accumulated, as an updating call
        would (replicas all-reduced, the norm and finiteness checked, clipping, the
        optimizer and scheduler stepped); with none, a one-step-stale store's waiting step.
        Every rank calls it."""
        if not self._accumulated:
            if self._host is not None and self._host.defers:
                self._host.flush()  # a one-step-stale update's step that waits, applied
                return self.settle()
            raise RuntimeError(
                "no gradients wait for an update: call train_step(..., update=False) first"
            )
        self._reduce_accumulated()
        self._accumulated, self._reduced = False, False
        self._updater.apply(None)
        self.settle()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip every rank's gradients to the global 2-norm ``max_norm``; return the norm
        before clipping (see :meth:`Updater.clip_grad_norm_`). Gradients that non-updating
        calls accumulated are first reduced over each stage's replicas, which hold only
        their own micro-batches' until then."""
        if self._accumulated:
            self._reduce_accumulated()
        return self._updater.clip_grad_norm_(max_norm)

    def _reduce_accumulated(self) -> None:
        """Reduce the accumulated gradients over each replicated stage's replicas, once."""
        if not self._reduced:
            for stage in sorted(self._reducers):
                self._reducers[stage].finish(self._weights.holders(stage, None))
            self._reduced = True

    @property
    def updates(self) -> int:
        """Updates applied so far (on an asynchronous schedule, each stage's count)."""
        return self._updater.updates

    @property
    def skipped_updates(self) -> int:
        """Updates skipped because of non-finite values or an fp16 overflow."""
        return self._updater.skipped_updates

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """This rank's optimizer (``None`` where its stages have no parameters)."""
        return self._updater.optimizer

    @property
    def lr_scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None:
        """This rank's learning-rate scheduler, if any."""
        return self._updater.lr_scheduler

    @property
    def precision(self) -> Precision:
        """The mixed-precision settings and the fp16 loss scale."""
        return self._updater.precision

    def progress(self) -> tuple[int, int]:
        """The updates applied and skipped, for a checkpoint; refused while gradients wait
        for an update or a stage holds more than its newest weights."""
        if self._accumulated:
            raise RuntimeError(
                "gradients of train_step(..., update=False) wait for an update, and a "
                "checkpoint does not keep them; save after an updating step"
            )
        for stage, stash in self._weights.stashes.items():
            if len(stash.versions) != 1:  # a call drains the pipeline: only the newest is left
                raise RuntimeError(f"stage {stage} holds {len(stash.versions)} weight versions")
        if self._host is not None:
            self._host.check_saving()
        return self.updates, self.skipped_updates

    def restore(self, progress: tuple[int, int] | None) -> None:
        """After a checkpoint's weights were loaded: take its counters ``progress`` (updates
        applied and skipped; ``None`` keeps these), make the loaded weights every stage's
        only version (numbered by the updates), and clear the gradients."""
        if progress is not None:
            self._updater.updates, self._updater.skipped_updates = progress
            for stash in self._weights.stashes.values():
                stash.newest = progress[0]  # version v: the weights after v updates
        self.reset_weights()
        self._clear_gradients()
        if self._host is not None:
            self._host.drop_pending()  # a step of the replaced weights
        self._accumulated = self._reduced = False
        self.settle()

    def settle(self) -> None:
        """After a run (ended or failed) or an update outside one: the host store's stages
        put back and their pages released, the optimizer's new state moved there."""
        if self._host is not None:
            self._host.settle(self.optimizer)

    def _clear_gradients(self) -> None:
        for module in self._weights.modules.values():
            for parameter in module.parameters():
                parameter.grad = None

    def weight_versions(self) -> dict[int, tuple[int, list[int]]]:
        """Each held stage's newest weight version and every version stashed (asynchronous
        schedules; none for synchronous ones)."""
        return {s: (st.newest, list(st.versions)) for s, st in self._weights.stashes.items()}

    def reset_weights(self) -> None:
        """Make the live weights (loaded from outside) the only version of every stage."""
        self._weights.reset()

    # within a run: the executor's calls --------------------------------------------------
    def begin(self, schedule: Schedule, lane: Sequence[Action], update: bool) -> None:
        """Start a run of ``lane`` (this rank's actions of ``schedule``); without ``update``
        its ``STEP``s apply nothing and replicas do not all-reduce (they will, once, at the
        update)."""
        self._schedule = schedule
        device = self._device
        self._loss = torch.zeros((), device=device)
        self._count = torch.zeros((), dtype=torch.float64, device=device)
        self._pairs = 0
        # the step's count is learnt after this rank's last backward: at its last STEP
        self._steps_left = sum(a.kind is Kind.STEP for a in lane)
        if self._host is not None:
            self._stepping, self._offloads = stepping_offloads(lane), {}
            self._host.begin(lane, update)
            self._steps_left = len(self._stepping)
        self._normalized = False
        self._reduced_loss: torch.Tensor | None = None  # by the update, when it sums them
        self._weights.begin(lane, update)
        reduced = self._reducers if update else {}
        self._arming = completing_passes(lane, reduced, schedule.split_backward)

    def version(self, stage: int, scheduled: int | None) -> int | None:
        """The weight version a pass of ``stage`` runs on (see :meth:`Weights.version`)."""
        return self._weights.version(stage, scheduled)

    def before_gradient_pass(self, stage: Stage, microbatch: int) -> None:
        """Before a pass of ``stage`` that may complete an update's gradients of a replicated
        stage: let it start the all-reduce of each bucket it completes."""
        if (stage.index, microbatch) in self._arming:
            self._reducers[stage.index].arm(stage.gradient_holders(microbatch))

    def add_loss(self, loss: Loss) -> None:
        """Add a last-stage forward's loss (and count, for a pair-returning loss)."""
        if self._mirror:
            return
        schedule = self._running
        self._loss += loss[0]
        if loss[1] is None:
            return
        if schedule.asynchronous:
            raise ValueError(
                f"{schedule.name} updates before a step's count is known, so its loss "
                "function must return a scalar mean, not (loss_sum, count); use a "
                "synchronous schedule (gpipe, 1f1b, interleaved, zb-h1) for token-level "
                "normalization"
            )
        self._count += loss[1].double()
        self._pairs += 1

    def on_load(self, stage: int) -> None:
        """``LOAD``: the stage's weights from the host store."""
        assert self._host is not None, "a host-stored schedule is assembled with its store"
        self._host.load(stage)

    def on_offload(self, stage: int) -> None:
        """``OFFLOAD``: the stage's gradients into the host store; its last one of the run
        that returns gradients is the stage's ``STEP``."""
        assert self._host is not None, "a host-stored schedule is assembled with its store"
        self._host.offload(stage)
        self._offloads[stage] = self._offloads.get(stage, 0) + 1
        if self._stepping.get(stage) == self._offloads[stage]:
            self.on_step(stage)

    def on_gather(self, stage: int) -> None:
        """``GATHER``: all-gather a sharded stage's parameters for the step's passes."""
        self._reducers[stage].gather()

    def on_allreduce(self, stage: int) -> None:
        """``ALLREDUCE``: finish a replicated stage's gradient all-reduce (when updating)."""
        if not self._weights.updating:
            return
        self._reducers[stage].finish(self._weights.holders(stage, None))
        self._weights.collect(stage)

    def on_step(self, stage: int) -> None:
        """``STEP``: the stage's update, applied by the weights; at this rank's last one of
        a synchronous run, the gradients are first divided by the step's count."""
        self._steps_left -= 1
        if self._steps_left > 0:
            self._weights.step(stage, self._loss)
            return
        # a synchronous update sums the loss statistics with its gradient norm, so LOSS
        # takes them from there instead of all-reducing again; where it can, the update
        # also divides by the step's count that they carry (one all-reduce, not two)
        if self._update_normalizes():
            self._normalized = True
            self._weights.step(stage, self._loss_stats(), self._normalize_summed)
        else:
            self._normalize()
            self._weights.step(stage, self._loss_stats())
        if self._weights.updating and not self._running.asynchronous:
            self._reduced_loss = self._updater.take_reduced_loss()

    def on_loss(self) -> torch.Tensor:
        """``LOSS``: the step's loss summed over every rank, as the mean over its updates."""
        schedule = self._running
        self._normalize()
        stats = self._reduced_loss
        if stats is None:
            stats = self._loss_stats()
            self._all_reduce(stats)
        pairs = round(float(stats[2]))
        if pairs:
            if not self._normalizer.normalizing:
                check_kinds(pairs, schedule.microbatches, False)
            stats[0] /= stats[1]
        loss = stats[0].float()
        per_update = self._per_update or schedule.microbatches
        # a synchronous step is one update, whatever its count (a token budget varies it)
        if per_update == schedule.microbatches or not schedule.asynchronous:
            return loss
        return loss.double() * per_update / schedule.microbatches

    @property
    def _running(self) -> Schedule:
        assert self._schedule is not None, "begin() starts every run"
        return self._schedule

    def _normalize(self) -> None:
        """Divide the step's gradients by its count, once (see :mod:`.normalize`)."""
        schedule = self._running
        if not self._normalized and not schedule.asynchronous:
            self._normalized = True
            self._normalizer.finish(
                self._count, self._pairs, schedule.microbatches, self._weights.updating
            )

    def _loss_stats(self) -> torch.Tensor:
        """This rank's share of the step's loss, its target count and its pair losses."""
        return torch.stack([self._loss.double(), self._count, self._count.new_tensor(self._pairs)])

    def _update_normalizes(self) -> bool:
        """Whether this rank's update, now, can divide the step's gradients by its count:
        a synchronous update, with no gradients of earlier steps put aside (their norm is
        known only once they are added back after the division)."""
        return (
            not self._normalized
            and not self._running.asynchronous
            and self._weights.updating
            and self._updater.active
            and self._normalizer.normalizing is not False
            and not self._normalizer.holds_aside
        )

    def _normalize_summed(self, reduced: torch.Tensor) -> float:
        """Divide by the step's count in the update's summed loss statistics."""
        return self._normalizer.divide(
            reduced[1], round(float(reduced[2])), self._running.microbatches, True
        )
