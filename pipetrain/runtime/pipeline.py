"""`Pipeline`: train a model with pipeline parallelism over a process group.

The pipeline checks that every rank was given the same settings, prepares the schedules
(:mod:`~pipetrain.runtime.steps`), has :mod:`~pipetrain.runtime.assembly` build this rank's
parts and offers the training loop's calls; a :class:`~pipetrain.runtime.steps.StepPlayer`
plays each step, the rank's :class:`~pipetrain.runtime.rank.cycle.UpdateCycle` owns updates.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import torch
import torch.distributed as dist
from torch import nn

import pipetrain.checkpoint as checkpoint  # its names import torch.distributed.checkpoint when used
from pipetrain.checkpoint.state import TrainingState
from pipetrain.model.frontend import FrontEnd, front_end
from pipetrain.model.graph import GraphModel
from pipetrain.runtime.agreement import check_agreement, settings_of
from pipetrain.runtime.assembly import OptimizerArg, assemble
from pipetrain.runtime.config import ModelSource, PipelineConfig, RuntimeConfig
from pipetrain.runtime.held import HeldStages
from pipetrain.runtime.model_io import ModelIO, evaluating, loss_function
from pipetrain.runtime.outputs import Destination, check_destination
from pipetrain.runtime.rank.batch import Data
from pipetrain.runtime.rank.precision import Precision
from pipetrain.runtime.rank.stage import LossFn
from pipetrain.runtime.rank.update_config import UpdateConfig
from pipetrain.runtime.steps import Outputs, Prepared, StepPlayer, prepare
from pipetrain.schedules import Schedule
from pipetrain.timeline import Timeline

if TYPE_CHECKING:
    from pipetrain.checkpoint import Checkpoint
    from pipetrain.planning import Plan


class Pipeline(HeldStages):
    """Train ``model`` split into stages over the ranks of a process group.

    Call it on every rank with the same arguments, inside a ``torch.distributed`` process
    group (``torchrun``, or :func:`pipetrain.launch`); each rank builds only its stage(s).

    Args:
        model: any ``nn.Module``, captured with :func:`torch.export.export` on
            ``source.example_inputs`` and cut into stages; or a model given as layers (an
            ``nn.Sequential``, a list of modules, or a module with ``pipeline_layers()``).
        balance: layers (graph: segments) per stage, by default shared out evenly (graph:
            by parameters); for a family with several stages per rank, one per model stage.
        microbatches: micro-batches per update (``pipedream``, which updates after every
            micro-batch: per call). :attr:`window` counts those of one call.
        schedule: a registered family's name (:func:`pipetrain.schedules.names`), or a
            :class:`~pipetrain.schedules.Schedule` value.
        loss_fn: ``(output, target) -> mean loss``, or ``-> (loss_sum, count)`` (synchronous
            families; the step's loss is then ``Σ loss_sum / Σ count``, see
            :func:`pipetrain.causal_lm_loss`). Omitted for a captured model, the model's
            own ``output.loss`` is used (give the labels among the inputs).
        recompute: ``"never"``, ``"except_last"`` or ``"always"``.
        optimizer: an optimizer, or a function from this rank's parameters to one.
        plan: a :class:`pipetrain.Plan`: balance, replicas, schedule, micro-batches.
        split_points: module paths each starting a stage of a captured model.
        max_grad_norm: clip the gradients to this global norm before every update.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (with GradScaler's loss scale).
        config: a :class:`~pipetrain.runtime.config.PipelineConfig` (replicas, options,
            targets on the first stage) that holds ``schedule``, ``microbatches``,
            ``balance`` and ``recompute`` too, given there instead.
        update: an :class:`~pipetrain.runtime.rank.update_config.UpdateConfig` (learning-rate
            scheduler, what a non-finite update does, the fp16 loss scale).
        runtime: a :class:`~pipetrain.runtime.config.RuntimeConfig` (device, process group,
            timeout, recording, gradient buckets).
        source: a :class:`~pipetrain.runtime.config.ModelSource` (example inputs to capture
            on, ``init_fn`` and ``weights`` for a meta-device model, deferred batch norm).

    Raises:
        ValueError: a setting that cannot run (named with its fix), or one that differs
            between ranks (on every rank; the model's structure counts).
    """

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module] | GraphModel,
        balance: Sequence[int] | None = None,
        microbatches: int = 1,
        schedule: str | Schedule = "1f1b",
        loss_fn: LossFn | None = None,
        recompute: str = "never",
        optimizer: OptimizerArg = None,
        *,
        plan: Plan | None = None,
        split_points: Sequence[str] | None = None,
        max_grad_norm: float | None = None,
        precision: str = "fp32",
        config: PipelineConfig | None = None,
        update: UpdateConfig | None = None,
        runtime: RuntimeConfig | None = None,
        source: ModelSource | None = None,
    ) -> None:
        """Build this rank's stage(s), the schedule and the transport."""
        runtime, source = runtime or RuntimeConfig(), source or ModelSource()
        runtime.check()
        self.front = front = front_end(model, source.example_inputs, split_points)
        loss_fn, own_loss = loss_function(loss_fn, front)
        flat = dict(
            balance=balance, microbatches=microbatches, schedule=schedule, recompute=recompute
        )
        self.config = PipelineConfig.from_arguments(config, plan, **flat)
        self.update_config = (update or UpdateConfig()).including(max_grad_norm, precision)
        self.group, self.rank = runtime.group, self.config.rank_of(dist.get_rank(runtime.group))
        prepared = self._prepare(front, (runtime, source), optimizer is not None)
        self.schedule, self.balance = prepared.schedule, prepared.balance
        self.window, self.per_update = self.schedule.microbatches, prepared.per_update
        self._rank = assemble(
            self.schedule,
            self.rank,
            front,
            self.balance,
            loss_fn,
            optimizer,
            config=self.config,
            update=self.update_config,
            runtime=runtime,
            source=source,
            per_update=prepared.per_update,
        )
        self.stages, self.transport = self._rank.stages, self._rank.transport
        self.device, self.recorder = self.transport.device, self._rank.recorder
        self._cycle = self._rank.cycle
        self.shared_parameters: list[str] = self._rank.shared_names
        """Parameters several stages use (each by its first stage's name), kept one."""
        self._evaluation = prepared.evaluation
        ships = self.config.targets_on_first_stage
        self._player = StepPlayer(self._rank, self.rank, self.group, prepared, ships)
        self._io = ModelIO(front, own_loss, self.rank, self.schedule, self.transport)

    def _prepare(
        self, front: FrontEnd, settings: tuple[RuntimeConfig, ModelSource], optimized: bool
    ) -> Prepared:
        """Check that every rank was given the same pipeline (ranks given different
        settings would train the wrong model: all stop here instead), then build the
        schedules and check the update settings against them."""
        agreed = settings_of(front.layers, self.config, self.update_config, *settings)
        check_agreement({**agreed, "optimizer": optimized}, self.group)
        prepared = prepare(self.config, dist.get_world_size(self.group), front, optimized)
        self.update_config.check(prepared.schedule, optimized)
        return prepared

    def reset_weights(self) -> None:
        """Make weights loaded from outside every stage's only version."""
        self._cycle.reset_weights()

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """This rank's optimizer (``None`` where its stages have no parameters)."""
        return self._cycle.optimizer

    @property
    def weight_versions(self) -> dict[int, tuple[int, list[int]]]:
        """Each held stage's newest weight version and those stashed (asynchronous)."""
        return self._cycle.weight_versions()

    @property
    def precision(self) -> Precision:
        """The mixed-precision settings, with the fp16 loss scale (``.scale``)."""
        return self._cycle.precision

    @overload
    def train_step(
        self,
        inputs: Data | None = None,
        targets: Data | None = None,
        *,
        update: bool = True,
        return_outputs: Literal[False] = False,
    ) -> float: ...

    @overload
    def train_step(
        self,
        inputs: Data | None = None,
        targets: Data | None = None,
        *,
        update: bool = True,
        return_outputs: Literal[True],
    ) -> tuple[float, Outputs | None]: ...

    def train_step(
        self,
        inputs: Data | None = None,
        targets: Data | None = None,
        *,
        update: bool = True,
        return_outputs: bool = False,
    ) -> float | tuple[float, Outputs | None]:
        """Run one mini-batch and return its mean loss (the same float on every rank); with
        ``return_outputs``, also the last stage's outputs (detached, in micro-batch order)
        on the first last-stage rank, ``None`` elsewhere.

        Synchronous schedules leave in ``.grad`` what ``loss_fn(model(inputs),
        targets).backward()`` gives the unpipelined model, and update once if an optimizer
        was given; with ``update=False`` the gradients wait and later calls add theirs, until
        an updating call or :meth:`update`. Asynchronous schedules update inside the step;
        the loss is then the mean over its updates. Only the first stage's ranks read
        ``inputs``, only the last stage's ``targets`` (or the first's, see
        :class:`~pipetrain.runtime.config.PipelineConfig`)."""
        if not update and self.schedule.asynchronous:
            raise ValueError(
                f"{self.schedule.name} updates the weights inside every step, so it cannot "
                "accumulate gradients over steps; use update=True (or a synchronous schedule)"
            )
        data = self._player.data(*self._io.step_data(inputs, targets), training=True)
        data.keep_outputs = return_outputs
        self._cycle.start_call(update)
        gather = self.schedule.stage_ranks[-1][0]
        outcome, outputs = self._player.play(
            self.schedule, data, update, to=gather if return_outputs else None
        )
        assert outcome.loss is not None  # every training schedule ends with LOSS
        loss = float(outcome.loss)
        return (loss, self._io.outputs(outputs)) if return_outputs else loss

    def update(self) -> None:
        """Apply (every rank) what ``update=False`` calls accumulated, or a waiting stale step."""
        if self.schedule.asynchronous:
            raise ValueError(f"{self.schedule.name} updates the weights inside every step")
        self._cycle.apply_accumulated()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip every rank's gradients to the global 2-norm ``max_norm``; return the norm
        before, as :func:`torch.nn.utils.clip_grad_norm_` on the unpipelined model would."""
        return self._cycle.clip_grad_norm_(max_norm)

    @property
    def lr_scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None:
        """This rank's learning-rate scheduler, if any."""
        return self._cycle.lr_scheduler

    @property
    def updates(self) -> int:
        """Updates applied so far (on an asynchronous schedule, each stage's count)."""
        return self._cycle.updates

    @property
    def skipped_updates(self) -> int:
        """Updates skipped because of non-finite values or an fp16 overflow."""
        return self._cycle.skipped_updates

    def eval_step(self, inputs: Data | None = None, *, to: Destination = "all") -> Outputs | None:
        """Forward only, without gradients, as ``model.eval()`` runs, on the newest weights:
        the outputs on every rank (``to="all"``), or on rank ``to`` (see ``ModelIO``)."""
        check_destination(to, self.schedule.num_ranks)
        data = self._player.data(self._io.evaluation_inputs(inputs), None, training=False)
        with evaluating(self.stages.values()), torch.no_grad():
            _, outputs = self._player.play(self._evaluation, data, to=to)
        return self._io.outputs(outputs, evaluation=True)

    def timeline(self) -> Timeline | None:
        """The last step's measured timeline on rank 0, ``None`` elsewhere (every rank calls it)."""
        if not self.recorder.enabled:
            raise RuntimeError("runtime=RuntimeConfig(record=True) is needed for a timeline")
        return self.recorder.gather(
            self.group, self.transport.global_rank(0), f"{self.schedule.name} (measured)"
        )

    def training_state(self) -> TrainingState:
        """This rank's training state, as a checkpoint saves and restores it."""
        return TrainingState(
            self.stages,
            self.optimizer,
            self.lr_scheduler,
            self.precision,
            self.schedule,
            self.balance,
            self._cycle,
            self.group,
            dist.get_rank(self.group),  # a process's own: tensor-parallel mirrors share ranks
        )

    def save(
        self,
        directory: str | os.PathLike,
        *,
        step: int | None = None,
        extra: Any = None,
        keep: int | None = None,
    ) -> Path:
        """Save the training state as ``directory/step-NNNNNNNN``; see :func:`.checkpoint.save`."""
        return checkpoint.save(self, directory, step=step, extra=extra, keep=keep)

    def load(
        self, path: str | os.PathLike, *, weights_only: bool = False, trust: bool = False
    ) -> Checkpoint:
        """Load a checkpoint saved with any layout (``path``, or the newest complete one
        under it); see :func:`pipetrain.checkpoint.load`."""
        return checkpoint.load(self, path, weights_only=weights_only, trust=trust)
