"""`Pipeline`: train a sequential model with pipeline parallelism over a process group.

The pipeline checks that every rank was given the same settings, prepares the schedules
(:mod:`~pipetrain.runtime.steps`), has :mod:`~pipetrain.runtime.assembly` build and wire
this rank's parts, and offers the training loop's calls; a
:class:`~pipetrain.runtime.steps.StepPlayer` plays each step. Targets shipped from the
input stage, the loss all-reduce and the gathering of evaluation outputs are actions of
the schedule like any other.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.checkpoint import Checkpoint
from pipetrain.checkpoint import load as load_checkpoint
from pipetrain.checkpoint import save as save_checkpoint
from pipetrain.model.capture import Inputs
from pipetrain.model.frontend import front_end
from pipetrain.model.graph import GraphModel
from pipetrain.model.materialize import InitFn
from pipetrain.model.weights_source import WeightsArg
from pipetrain.runtime.agreement import check_agreement, settings_of
from pipetrain.runtime.assembly import OptimizerArg, UpdateSettings, assemble
from pipetrain.runtime.batch import Data
from pipetrain.runtime.batchnorm import deferred_layers
from pipetrain.runtime.config import PipelineConfig
from pipetrain.runtime.model_io import ModelIO, model_loss
from pipetrain.runtime.outputs import Destination, check_destination
from pipetrain.runtime.precision import LossScale, Precision
from pipetrain.runtime.stage import LossFn
from pipetrain.runtime.steps import Outputs, StepPlayer, prepare
from pipetrain.runtime.torch_transport import default_device, indexed
from pipetrain.runtime.update import LRSchedulerFactory, check_training
from pipetrain.schedules import Schedule
from pipetrain.timeline import Timeline

if TYPE_CHECKING:
    from pipetrain.planning import Plan


class Pipeline:
    """Train ``model`` split into stages over the ranks of a process group.

    Call it on every rank with the same arguments, inside an initialized
    ``torch.distributed`` process group (``torchrun``, or :func:`pipetrain.launch`). Each
    rank builds only its own stage(s).

    Args:
        model: any ``nn.Module``, captured as a graph with :func:`torch.export.export` on
            ``example_inputs`` and cut into stages (at ``split_points``, or between its
            blocks, see :mod:`pipetrain.model.graph`); or a model given as layers (an
            ``nn.Sequential``, a list of modules, or a module with ``pipeline_layers()``).
            A parameter that several stages use stays one parameter: the stages' parts of
            its gradient are summed before every update (synchronous families).
        balance: layers (graph: segments) per stage, by default shared out evenly (graph:
            by parameters); for a family with several stages per rank, one per model stage.
        microbatches: micro-batches per update (for ``pipedream``, mini-batches per call).
        schedule: a registered family's name (:func:`pipetrain.schedules.names`), or a
            :class:`~pipetrain.schedules.Schedule` value, built or read with
            :meth:`Schedule.from_text <pipetrain.schedules.Schedule.from_text>`.
        loss_fn: ``(output, target) -> mean loss``, or ``-> (loss_sum, count)`` (synchronous
            families): the step's loss is then the sum of every micro-batch's ``loss_sum``
            over the sum of their ``count``, such as a token mean over a padded batch
            (:func:`pipetrain.causal_lm_loss`). ``output`` is what the model returns (a
            tensor, tuple, dict or ``ModelOutput``). Omitted for a captured model, the
            model's own ``output.loss`` is used (give the labels among the inputs).
        recompute: ``"never"``, ``"except_last"`` or ``"always"``.
        optimizer: an optimizer, or a function from this rank's parameters to one; stepped
            once per updating :meth:`train_step` (or :meth:`update`), or at every update of
            an asynchronous family.
        plan: a :class:`pipetrain.Plan` giving balance, replicas, schedule, options,
            micro-batches and recomputation.
        replicas: ranks per stage, for replicable families.
        schedule_options: the family's options, such as ``{"virtual": 2}``.
        targets_on_first_stage: the first stage's ranks are given the targets too, and the
            first sends them to the last stage's ranks (those not holding the first stage),
            so only the input stage's ranks need to load data.
        device: where this rank computes (by default its GPU under NCCL, else the CPU).
        group: the process group (the default one if ``None``).
        timeout_s: how long any transfer, and the loss and gradient-norm all-reduces, may
            wait; a peer that froze (its heartbeat stopped) is named within seconds instead
            (gloo; see :mod:`pipetrain.runtime.heartbeat`). The other collectives (the
            agreement check at construction, checkpoints, replicas' gradients) wait as long
            as the process group's timeout, which :func:`pipetrain.launch` and ``pipetrain
            train --timeout`` set from the same value.
        record: record a measured timeline of every step (see :meth:`timeline`).
        bucket_bytes: a replicated stage all-reduces its gradients in buckets of up to this
            size, each started as soon as the update's last backward has produced it. By
            default 4 MiB on GPUs; on CPUs the whole stage is one bucket, because there the
            all-reduce's thread takes cores from the computation it would overlap.
        config: a :class:`~pipetrain.runtime.config.PipelineConfig` holding every setting
            above but the model, loss and optimizer, instead of them.
        max_grad_norm: clip the gradients to this global norm before every update, as
            :func:`torch.nn.utils.clip_grad_norm_` on the whole model (synchronous
            families; see :meth:`clip_grad_norm_`).
        lr_scheduler: a function from the optimizer to a learning-rate scheduler, stepped
            after every applied update; ``None`` on a rank whose stages have no parameters
            (see :attr:`lr_scheduler`).
        on_nonfinite: what an update whose loss or global gradient norm is not finite does:
            ``"raise"`` a :class:`~pipetrain.runtime.update.NonFiniteError` on every rank,
            ``"skip"`` it on every rank (gradients cleared, counted in
            :attr:`skipped_updates`), or ``"warn"`` and skip. The weights are never changed
            by such an update. Asynchronous families check each stage's update on its own
            rank and only ``"raise"``.
        precision: ``"fp32"``; ``"bf16"``: every forward (and recomputation) under
            :func:`torch.autocast` with bfloat16; ``"fp16"``: with float16 and a loss scale
            (``loss_scale``; synchronous families, with an optimizer) that behaves exactly as
            :class:`torch.amp.GradScaler` on the unpipelined model: an update whose
            gradients overflow on any rank is skipped on every rank (counted in
            :attr:`skipped_updates`) and the scale backs off. A non-finite loss is left to
            ``on_nonfinite``. Losses are taken and summed in float32 in every precision.
        loss_scale: the fp16 loss scale's policy, a
            :class:`~pipetrain.runtime.precision.LossScale` (GradScaler's defaults if
            ``None``).
        init_fn: a function of a stage module that initializes its tensors in place, for a
            model built on the meta device (``with torch.device("meta"):``); each rank
            allocates only its own stages' tensors and initializes them with it, or by
            default with each module's ``reset_parameters()`` (see
            :func:`~pipetrain.model.materialize.materialize`, which raises naming any
            tensor left unset).
        weights: the initial weights: a state dict keyed by the full model's names, or the
            path of a ``.safetensors`` file or a ``torch.save``d state dict; each rank reads
            only its stages' entries (every one of them must be there) and copies them in,
            after ``init_fn``, whether the model was built on the meta device or not.
        example_inputs: a sample of a captured model's inputs with at least 2 rows (a
            tensor, tuple, or dict of keyword inputs, such as ``{"input_ids": ids[:2]}``);
            the steps' inputs are then given the same way.
        split_points: module paths each starting a stage of a captured model, such as
            ``["transformer.h.6"]``.
        deferred_batch_norm: batch-normalization layers (``nn.BatchNorm1d``/``2d``/``3d``
            modules of the layers) update their running statistics once per step from the
            whole mini-batch, as on the unpipelined model run on the whole batch, instead of
            once per micro-batch; each micro-batch is still normalized with its own
            statistics (see :mod:`pipetrain.runtime.batchnorm`). Synchronous families,
            without replicas.

    Raises:
        ValueError: a setting that cannot run, named with its fix; or settings (model
            structure included) that differ between ranks, on every rank, naming each.
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
        replicas: Sequence[int] | None = None,
        schedule_options: dict[str, int | bool] | None = None,
        targets_on_first_stage: bool = False,
        device: torch.device | str | None = None,
        group: dist.ProcessGroup | None = None,
        timeout_s: float = 300.0,
        record: bool = False,
        bucket_bytes: float | None = None,
        config: PipelineConfig | None = None,
        max_grad_norm: float | None = None,
        lr_scheduler: LRSchedulerFactory | None = None,
        on_nonfinite: str = "raise",
        precision: str = "fp32",
        loss_scale: LossScale | None = None,
        example_inputs: Inputs | None = None,
        split_points: Sequence[str] | None = None,
        init_fn: InitFn | None = None,
        weights: WeightsArg | None = None,
        deferred_batch_norm: bool = False,
    ) -> None:
        """Build this rank's stage(s), the schedule and the transport."""
        if not dist.is_initialized():
            raise RuntimeError(
                "Pipeline needs an initialized torch.distributed process group: run under "
                "torchrun, or start workers with pipetrain.launch(fn, nprocs=N)"
            )
        self.front = front = front_end(model, example_inputs, split_points)
        own_loss = loss_fn is None and isinstance(front, GraphModel)
        if own_loss:
            loss_fn = model_loss
        if loss_fn is None or not callable(loss_fn):
            raise TypeError(
                f"loss_fn must be a callable (output, target) -> mean loss, got {loss_fn!r}"
            )
        self.config = config = PipelineConfig.from_arguments(
            config,
            plan,
            balance=balance,
            microbatches=microbatches,
            schedule=schedule,
            recompute=recompute,
            replicas=replicas,
            schedule_options=schedule_options,
            targets_on_first_stage=targets_on_first_stage,
            device=device,
            timeout_s=timeout_s,
            record=record,
            bucket_bytes=bucket_bytes,
        )
        self.group = group
        self.rank = dist.get_rank(group)
        # ranks given different settings would train the wrong model: all stop here instead
        check_agreement(
            settings_of(
                config,
                front.layers,
                optimizer=optimizer is not None,
                max_grad_norm=max_grad_norm,
                lr_scheduler=lr_scheduler is not None,
                on_nonfinite=on_nonfinite,
                precision=precision,
                loss_scale=loss_scale,
                init_fn=init_fn is not None,
                weights=weights is not None,
                deferred_batch_norm=deferred_batch_norm,
            ),
            group,
        )
        prepared = prepare(config, dist.get_world_size(group), front, optimizer is not None)
        built = self.schedule = prepared.schedule
        self.balance = prepared.balance
        self._per_update = prepared.per_update
        check_training(
            built, optimizer is not None, max_grad_norm, lr_scheduler, on_nonfinite, precision
        )
        self._evaluation = prepared.evaluation
        if deferred_batch_norm:
            if isinstance(front, GraphModel):
                raise ValueError(
                    "deferred_batch_norm converts nn.BatchNorm layers, so it needs the model "
                    "given as layers (nn.Sequential or pipeline_layers()), not captured"
                )
            front.layers = deferred_layers(front.layers, built)
        self.microbatches = built.microbatches
        self.device = indexed(config.device) if config.device is not None else default_device(group)
        self._rank = assemble(
            built,
            self.rank,
            front,
            self.balance,
            loss_fn,
            optimizer,
            device=self.device,
            group=group,
            timeout_s=config.timeout_s,
            recompute=config.recompute,
            record=config.record,
            bucket_bytes=config.bucket_bytes,
            settings=UpdateSettings(
                max_grad_norm, lr_scheduler, on_nonfinite, precision, loss_scale or LossScale()
            ),
            init_fn=init_fn,
            initial_weights=weights,
        )
        self.stages = self._rank.stages
        self.optimizer = self._rank.optimizer
        self.transport, self.recorder = self._rank.transport, self._rank.recorder
        self.weights = self._rank.weights
        self.shared_parameters: list[str] = self._rank.shared.names
        """Parameters several stages use (each by its first stage's name), kept one."""
        self.precision: Precision = self._rank.updater.precision
        self._player = StepPlayer(
            self._rank, self.rank, group, prepared, config.targets_on_first_stage, self.device
        )
        self._accumulated = False  # gradients of non-updating steps wait for an update
        last = built.stages - 1 in built.stages_of(self.rank)
        self._io = ModelIO(front, own_loss, self.rank if last else None)

    # parameters -----------------------------------------------------------------------
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters, named as in the full model."""
        for module in self.stages.values():
            yield from module.named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters."""
        for _, parameter in self.named_parameters():
            yield parameter

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers, keyed as in the full model."""
        state: dict[str, torch.Tensor] = {}
        for module in self.stages.values():
            state.update(module.state_dict())
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load this rank's entries from a (full or partial) state dict keyed as the full model."""
        for module in self.stages.values():
            keys = module.state_dict().keys()
            module.load_state_dict({k: v for k, v in state.items() if k in keys})
        self.weights.reset()

    # steps ----------------------------------------------------------------------------
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

    @overload
    def train_step(
        self,
        inputs: Data | None = None,
        targets: Data | None = None,
        *,
        update: bool = True,
        return_outputs: bool,
    ) -> float | tuple[float, Outputs | None]: ...

    def train_step(
        self,
        inputs: Data | None = None,
        targets: Data | None = None,
        *,
        update: bool = True,
        return_outputs: bool = False,
    ) -> float | tuple[float, Outputs | None]:
        """Run one mini-batch through the schedule and return its mean loss (the same float
        on every rank); with ``return_outputs``, ``(loss, outputs)``.

        Synchronous schedules leave each parameter's accumulated gradient in ``.grad`` as the
        unpipelined model would get from ``loss_fn(model(inputs), targets).backward()``, and
        update once if an optimizer was given: the global gradient norm and the loss are
        checked (``on_nonfinite``), the gradients clipped (``max_grad_norm``), the optimizer
        and the learning-rate scheduler stepped.

        With ``update=False`` (synchronous schedules only) nothing is updated and the
        gradients are kept: the next calls add theirs, exactly as ``loss.backward()`` on the
        unpipelined model for each mini-batch without zeroing (each call's loss is its own
        mini-batch's mean, so the sum of the calls' gradients is what accumulates), and a
        later updating call, or :meth:`update`, applies them all. A call that follows an
        update starts from cleared gradients. Asynchronous ones update inside the step, at every
        update the schedule makes (``pipedream``: one per mini-batch of the ``microbatches``
        the batch is split into; ``2bw``: ``rounds`` updates of ``microbatches``
        micro-batches); the loss returned is then the mean over updates. The pipeline drains
        at the end of the call. Only the first stage's ranks read ``inputs``, only the last
        stage's ``targets`` (the first stage's, with ``targets_on_first_stage``).

        ``return_outputs=True`` also returns the last stage's outputs of the mini-batch
        (detached, concatenated in micro-batch order; a tuple for a stage with several) on
        the first last-stage rank, which gathers a replicated last stage's micro-batches,
        and ``None`` on every other rank; for training metrics such as accuracy.
        """
        if not update and self.schedule.asynchronous:
            raise ValueError(
                f"{self.schedule.name} updates the weights inside every step, so it cannot "
                "accumulate gradients over steps; use update=True (or a synchronous schedule)"
            )
        data = self._player.data(*self._io.step_data(inputs, targets), training=True)
        data.keep_outputs = return_outputs
        if not self._accumulated:
            for parameter in self.parameters():
                parameter.grad = None
            self._rank.updater.start()
        else:  # only this call's gradients are divided by its count (pair losses)
            self._rank.executor.normalizer.set_aside()
        self._accumulated = not update
        gather = self.schedule.stage_ranks[-1][0]
        outcome, outputs = self._player.play(
            self.schedule, data, update, to=gather if return_outputs else None
        )
        assert outcome.loss is not None  # every training schedule ends with LOSS
        loss = float(outcome.loss) * self._per_update / self.microbatches
        return (loss, self._io.outputs(outputs)) if return_outputs else loss

    def update(self) -> None:
        """Apply the gradients accumulated by ``train_step(..., update=False)`` calls, as an
        updating ``train_step`` would (replicas all-reduced, the norm and finiteness checked,
        clipping, the optimizer and scheduler stepped). Every rank must call it."""
        if self.schedule.asynchronous:
            raise ValueError(f"{self.schedule.name} updates the weights inside every step")
        if not self._accumulated:
            raise RuntimeError(
                "no gradients wait for an update: call train_step(..., update=False) first"
            )
        self._accumulated = False
        for stage in sorted(self._rank.reducers):
            self._rank.reducers[stage].finish(self.weights.holders(stage, None))
        self._rank.updater.apply(None)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale every rank's gradients so that their global 2-norm is at most ``max_norm``
        and return the norm before clipping (the same float on every rank), as
        :func:`torch.nn.utils.clip_grad_norm_` on the unpipelined model would. A replicated
        stage's gradients count once; every rank must call it, after a step that reduced
        the replicas (an updating one)."""
        return self._rank.updater.clip_grad_norm_(max_norm)

    @property
    def lr_scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None:
        """This rank's learning-rate scheduler (``None`` where no optimizer is: a rank whose
        stages have no parameters still counts the updates in :attr:`updates`)."""
        return self._rank.updater.lr_scheduler

    @property
    def updates(self) -> int:
        """Updates applied so far (on an asynchronous schedule, each stage's count)."""
        return self._rank.updater.updates

    @property
    def skipped_updates(self) -> int:
        """Updates skipped because of non-finite values (``on_nonfinite="skip"`` or ``"warn"``)."""
        return self._rank.updater.skipped_updates

    def eval_step(self, inputs: Data | None = None, *, to: Destination = "all") -> Outputs | None:
        """Forward only, without gradients, on the newest weights: the model's outputs on
        ``inputs`` (concatenated over the micro-batches; a tuple for a last stage with
        several) on every rank (``to="all"``), or on rank ``to`` only and ``None`` elsewhere.

        Every stage module this rank holds is in eval mode for the call (dropout off, batch
        normalization on its running statistics); each module's own mode is restored
        afterwards, also when the call raises. Every rank must call it with the same ``to``;
        only the first stage's ranks read ``inputs``.
        """
        check_destination(to, dist.get_world_size(self.group))
        data = self._player.data(self._io.inputs(inputs), None, training=False)
        modes = [(m, m.training) for module in self.stages.values() for m in module.modules()]
        try:
            for module in self.stages.values():
                module.eval()
            with torch.no_grad():
                _, outputs = self._player.play(self._evaluation, data, to=to)
        finally:
            for layer, training in modes:
                layer.training = training
        return self._io.outputs(outputs)

    def timeline(self) -> Timeline | None:
        """The last step's measured timeline, gathered on rank 0 (``None`` on other ranks).

        Every rank must call it. Needs ``record=True``.
        """
        if not self.recorder.enabled:
            raise RuntimeError("Pipeline(record=True) is needed to measure a timeline")
        return self.recorder.gather(
            self.group, self.transport.global_rank(0), f"{self.schedule.name} (measured)"
        )

    # checkpoints ------------------------------------------------------------------------
    def save(
        self,
        directory: str | os.PathLike,
        *,
        step: int | None = None,
        extra: Any = None,
        keep: int | None = None,
    ) -> Path:
        """Save the whole training state as ``directory/step-NNNNNNNN`` (``step``: by default
        the updates so far) and return it; rank 0's ``extra`` (such as the data position)
        is saved beside. Every rank calls it, after an updating step; the directory appears
        complete or not at all, and with ``keep`` only the ``keep`` newest stay. See
        :func:`pipetrain.checkpoint.save`."""
        return save_checkpoint(self, directory, step=step, extra=extra, keep=keep)

    def load(self, path: str | os.PathLike, *, weights_only: bool = False) -> Checkpoint:
        """Load a checkpoint saved with any layout (``path``, or the newest complete one
        under it) and return what was found, with the ``extra`` saved. Every rank calls it;
        a checkpoint of another model is refused on every rank, naming the differences.
        See :func:`pipetrain.checkpoint.load`."""
        return load_checkpoint(self, path, weights_only=weights_only)
