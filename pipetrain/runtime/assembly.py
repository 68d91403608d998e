"""What one rank of a pipeline is made of, built and wired: :func:`assemble`.

A rank holds the modules of its stages, their :class:`~pipetrain.runtime.stage.Stage`
state, the :class:`~pipetrain.runtime.weights.Weights` (versions and the optimizer) with the
:class:`~pipetrain.runtime.update.Updater` deciding each update, the mixed-precision
settings, gradient reducers for replicated stages, the transport, the recorder and the
:class:`~pipetrain.runtime.executor.Executor` that plays the schedule against them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.model.layers import StageModule, stage_bounds
from pipetrain.model.materialize import InitFn, materialize
from pipetrain.model.weights_source import WeightsArg
from pipetrain.runtime.executor import Executor
from pipetrain.runtime.precision import LossScale, Precision
from pipetrain.runtime.recorder import Recorder
from pipetrain.runtime.reduce import GradientReducer, replica_reducers
from pipetrain.runtime.stage import LossFn, Stage
from pipetrain.runtime.torch_transport import TorchTransport
from pipetrain.runtime.update import LRSchedulerFactory, Updater
from pipetrain.runtime.weights import Weights
from pipetrain.schedules import Schedule

OptimizerArg = (
    torch.optim.Optimizer | Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer] | None
)


@dataclass(frozen=True)
class UpdateSettings:
    """What every update does beyond the optimizer's step (see :class:`Updater`)."""

    max_grad_norm: float | None = None
    lr_scheduler: LRSchedulerFactory | None = None
    on_nonfinite: str = "raise"
    precision: str = "fp32"
    loss_scale: LossScale = field(default_factory=LossScale)


@dataclass
class Rank:
    """One rank's built parts."""

    stages: dict[int, StageModule]
    optimizer: torch.optim.Optimizer | None
    transport: TorchTransport
    recorder: Recorder
    updater: Updater
    weights: Weights
    reducers: dict[int, GradientReducer]
    executor: Executor


def assemble(
    schedule: Schedule,
    rank: int,
    layers: Sequence[tuple[str, nn.Module]],
    balance: Sequence[int],
    loss_fn: LossFn,
    optimizer: OptimizerArg,
    *,
    device: torch.device,
    group: dist.ProcessGroup | None,
    timeout_s: float,
    recompute: str,
    record: bool,
    bucket_bytes: float | None,
    settings: UpdateSettings,
    init_fn: InitFn | None = None,
    initial_weights: WeightsArg | None = None,
) -> Rank:
    """Build rank ``rank``'s stages of the named ``layers`` (cut by ``balance``) and wire them;
    each stage module is materialized on ``device`` from ``init_fn`` and ``initial_weights``
    (see :func:`materialize`)."""
    bounds = stage_bounds(balance)
    stages = {
        stage: materialize(
            StageModule(layers[slice(*bounds[stage])]),
            device,
            init_fn=init_fn,
            weights=initial_weights,
        )
        for stage in schedule.stages_of(rank)
    }
    parameters = [p for module in stages.values() for p in module.parameters()]
    updates = optimizer is not None  # the same on every rank, unlike the optimizer built
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        # a stage of parameter-free layers (activations, pooling) has nothing to optimize
        optimizer = optimizer(iter(parameters)) if parameters else None
    transport = TorchTransport(device, group, timeout_s)
    # a replicated stage's gradients enter the global norm once, from its first replica
    counted = [
        p
        for stage, module in stages.items()
        if schedule.stage_ranks[stage][0] == rank
        for p in module.parameters()
        if p.requires_grad
    ]
    precision = Precision(settings.precision, device, settings.loss_scale)
    updater = Updater(
        optimizer,
        active=updates,
        parameters=[p for p in parameters if p.requires_grad],
        counted=counted,
        all_reduce=transport.all_reduce,
        all_reduce_start=transport.all_reduce_start,
        device=device,
        max_grad_norm=settings.max_grad_norm,
        on_nonfinite=settings.on_nonfinite,
        lr_scheduler=settings.lr_scheduler,
        precision=precision,
    )
    weights = Weights(stages, optimizer, schedule.asynchronous, updater)
    runners = {
        index: Stage(
            index,
            weights,
            loss_fn,
            last=index == schedule.stages - 1,
            recompute=recompute,
            microbatches=schedule.microbatches,
            split_backward=schedule.split_backward,
            precision=precision,
        )
        for index in stages
    }
    recorder = Recorder(rank, device, enabled=record)
    reducers = replica_reducers(stages, schedule, transport.global_rank, device, bucket_bytes)
    executor = Executor(rank, runners, transport, weights, recorder, reducers)
    return Rank(stages, optimizer, transport, recorder, updater, weights, reducers, executor)
