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

from pipetrain.model.frontend import FrontEnd, shared_parameters
from pipetrain.model.layers import stage_bounds
from pipetrain.model.materialize import InitFn, materialize
from pipetrain.model.weights_source import WeightsArg
from pipetrain.runtime.executor import Executor
from pipetrain.runtime.io_threads import defer_gloo_io_threads
from pipetrain.runtime.precision import LossScale, Precision
from pipetrain.runtime.recorder import Recorder
from pipetrain.runtime.reduce import GradientReducer, replica_reducers
from pipetrain.runtime.shared import SharedGradients, counted_once
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

    stages: dict[int, nn.Module]
    optimizer: torch.optim.Optimizer | None
    transport: TorchTransport
    recorder: Recorder
    updater: Updater
    weights: Weights
    reducers: dict[int, GradientReducer]
    executor: Executor
    shared: SharedGradients


def assemble(
    schedule: Schedule,
    rank: int,
    front: FrontEnd,
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
    """Build rank ``rank``'s stages of the model (``front``'s layers cut by ``balance``)
    and wire them; each stage module is materialized on ``device`` from ``init_fn`` and
    ``initial_weights`` (see :func:`materialize`)."""
    bounds = stage_bounds(balance)
    stages = {
        stage: materialize(
            front.stage(*bounds[stage], device), device, init_fn=init_fn, weights=initial_weights
        )
        for stage in schedule.stages_of(rank)
    }
    shared = shared_parameters(front, balance)
    if shared and schedule.asynchronous and any(len(r) > 1 for r in schedule.stage_ranks):
        raise ValueError(
            f"parameters {[s.names[s.stages[0]] for s in shared][:3]} are used by several "
            f"stages, which {schedule.name} cannot keep equal with replicated stages; "
            "use a synchronous schedule, no replicas, or a cut with one stage holding them"
        )
    # a parameter two of this rank's stages use is one tensor: optimized once
    parameters = list({id(p): p for m in stages.values() for p in m.parameters()}.values())
    updates = optimizer is not None  # the same on every rank, unlike the optimizer built
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        # a stage of parameter-free layers (activations, pooling) has nothing to optimize
        optimizer = optimizer(iter(parameters)) if parameters else None
    transport = TorchTransport(device, group, timeout_s)
    sharing = SharedGradients(shared, schedule, stages, transport.global_rank)
    sharing.synchronize()
    precision = Precision(settings.precision, device, settings.loss_scale)
    updater = Updater(
        optimizer,
        active=updates,
        parameters=[p for p in parameters if p.requires_grad],
        counted=counted_once(stages, schedule, rank, shared),
        reduce_shared=sharing.reduce,
        all_reduce=transport.all_reduce,
        all_reduce_start=transport.all_reduce_start,
        device=device,
        max_grad_norm=settings.max_grad_norm,
        on_nonfinite=settings.on_nonfinite,
        lr_scheduler=settings.lr_scheduler,
        precision=precision,
    )
    weights = Weights(stages, optimizer, schedule.asynchronous, updater, sharing.reduce)
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
            output_of=front.outputs,
        )
        for index in stages
    }
    recorder = Recorder(rank, device, enabled=record)
    reducers = replica_reducers(stages, schedule, transport.global_rank, device, bucket_bytes)
    defer_gloo_io_threads()  # the shared weights' and the replicas' groups started theirs
    executor = Executor(rank, runners, transport, weights, recorder, reducers)
    return Rank(
        stages, optimizer, transport, recorder, updater, weights, reducers, executor, sharing
    )
