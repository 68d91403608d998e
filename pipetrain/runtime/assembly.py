"""What one rank of a pipeline is made of, built and wired: :func:`assemble`.

A rank holds the modules of its stages, their :class:`~pipetrain.runtime.rank.stage.Stage`
state, the :class:`~pipetrain.runtime.rank.weights.Weights` (versions and the optimizer),
the :class:`~pipetrain.runtime.rank.cycle.UpdateCycle` that owns its updates, gradient
reducers for replicated stages, the transport, the recorder and the
:class:`~pipetrain.runtime.rank.executor.Executor` that plays the schedule against them.
The transport is given (the loopback one between threads, say) or made over
torch.distributed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pipetrain.distributed.io_threads import defer_gloo_io_threads
from pipetrain.distributed.mirrored import MirroredTransport
from pipetrain.distributed.torch_transport import TorchTransport, default_device, indexed
from pipetrain.distributed.transport import Transport
from pipetrain.model.frontend import FrontEnd, shared_parameters
from pipetrain.model.graph import GraphModel
from pipetrain.model.layers import stage_bounds
from pipetrain.model.materialize import materialize
from pipetrain.runtime.config import ModelSource, PipelineConfig, RuntimeConfig
from pipetrain.runtime.rank.batchnorm import deferred_layers
from pipetrain.runtime.rank.cycle import UpdateCycle
from pipetrain.runtime.rank.executor import Executor
from pipetrain.runtime.rank.precision import LossScale, Precision
from pipetrain.runtime.rank.recorder import Recorder
from pipetrain.runtime.rank.reduce import Reducer, replica_groups, replica_reducers
from pipetrain.runtime.rank.shard import ShardedReducer, shard_stage
from pipetrain.runtime.rank.shared import SharedGradients, check_sharing, counted_once
from pipetrain.runtime.rank.stage import LossFn, Stage
from pipetrain.runtime.rank.stale_store import StaleHostWeights
from pipetrain.runtime.rank.stored_stage import HostWeights
from pipetrain.runtime.rank.tensor_parallel import Mirrors, counted_by_mirror, stage_plan
from pipetrain.runtime.rank.update import Updater
from pipetrain.runtime.rank.update_config import UpdateConfig
from pipetrain.runtime.rank.weights import Weights
from pipetrain.schedules import Schedule

OptimizerArg = (
    torch.optim.Optimizer | Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer] | None
)


@dataclass
class Rank:
    """One rank's built parts."""

    stages: dict[int, nn.Module]
    transport: Transport
    recorder: Recorder
    cycle: UpdateCycle
    executor: Executor
    shared_names: list[str]


def _stage_modules(
    schedule: Schedule,
    rank: int,
    front: FrontEnd,
    balance: Sequence[int],
    device: torch.device,
    source: ModelSource,
    host: HostWeights | None = None,
) -> dict[int, nn.Module]:
    """This rank's stage modules, materialized on ``device`` (see :func:`materialize`); with
    a ``host`` store, each moved there as soon as it is made, so the rank never holds more
    than one stage's weights privately."""
    if source.deferred_batch_norm:
        if isinstance(front, GraphModel):
            raise ValueError(
                "deferred_batch_norm converts nn.BatchNorm layers, so it needs the model "
                "given as layers (nn.Sequential or pipeline_layers()), not captured"
            )
        front.layers = deferred_layers(front.layers, schedule)
    bounds = stage_bounds(balance)
    modules = {}
    for stage in schedule.stages_of(rank):
        module = front.stage(*bounds[stage], device)
        modules[stage] = materialize(module, device, init_fn=source.init_fn, weights=source.weights)
        if host is not None:
            host.adopt(stage, module)
    return modules


def assemble(
    schedule: Schedule,
    rank: int,
    front: FrontEnd,
    balance: Sequence[int],
    loss_fn: LossFn,
    optimizer: OptimizerArg,
    *,
    config: PipelineConfig | None = None,
    update: UpdateConfig | None = None,
    runtime: RuntimeConfig | None = None,
    source: ModelSource | None = None,
    per_update: int | None = None,
    transport: Transport | None = None,
) -> Rank:
    """Build rank ``rank``'s stages of the model (``front``'s layers cut by ``balance``)
    and wire them to ``transport`` (by default over torch.distributed, from ``runtime``'s
    device, group and timeout); ``config`` says what to recompute and whether to shard each
    replicated stage over its replicas; ``per_update`` counts the micro-batches of one update
    (by default all of a run's)."""
    config, update, runtime = (
        config or PipelineConfig(),
        update or UpdateConfig(),
        runtime or RuntimeConfig(),
    )
    degree, given = config.tensor_parallel, config.tensor_parallel_plan
    plan = stage_plan(front, balance, degree, given, transport is None)
    mirrors: Mirrors | None = None
    if transport is None:
        device = indexed(runtime.device) if runtime.device is not None else None
        device = device or default_device(runtime.group)
        transport = TorchTransport(device, runtime.group, runtime.timeout_s, runtime.frozen_after_s)
        if plan is not None:
            mirrors = Mirrors(degree, runtime.group, transport.global_rank)
            groups = mirrors.replica_groups(schedule)
            transport = MirroredTransport(transport, mirrors.degree, mirrors.messages)
    device = transport.device
    host = _host_weights(schedule, device)
    stages = _stage_modules(schedule, rank, front, balance, device, source or ModelSource(), host)
    shared = shared_parameters(front, balance)
    check_sharing(shared, schedule)
    meshes = {}  # a sharded tensor-parallel stage's (dp, tp) mesh
    if mirrors is None or plan is None:
        groups = replica_groups(schedule, transport.global_rank)
    else:
        for s in stages:
            ranks, group = schedule.stage_ranks[s], groups.get(s) if config.shard else None
            meshes[s] = mirrors.mesh(device, ranks, group)
            stages[s] = mirrors.parallelize(stages[s], plan, meshes[s])
    replicated = [s for s in stages if config.shard and s in groups]
    sharing = (
        SharedGradients(shared, schedule, stages, transport.global_rank, rank, config.shard)
        if mirrors is None
        else mirrors.shared_gradients(shared, schedule, stages, rank, config.shard)
    )
    sharing.synchronize()  # whole copies, before any is sharded
    sharded = {
        s: shard_stage(stages[s], groups[s], device, meshes[s]["dp"] if s in meshes else None)
        for s in replicated
    }
    # a parameter two of this rank's stages use is one tensor: optimized once
    parameters = list({id(p): p for m in stages.values() for p in m.parameters()}.values())
    updates = optimizer is not None  # the same on every rank, unlike the optimizer built
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        # a stage of parameter-free layers (activations, pooling) has nothing to optimize
        optimizer = optimizer(iter(parameters)) if parameters else None
    precision = Precision(update.precision, device, update.loss_scale or LossScale())
    updater = Updater(
        optimizer,
        active=updates,
        parameters=[p for p in parameters if p.requires_grad],
        counted=counted_by_mirror(
            counted_once(stages, schedule, rank, shared, sharded), mirrors is None or mirrors.leads
        ),
        reduce_shared=sharing.reduce,
        count_shared_once=sharing.count_once,
        all_reduce=transport.all_reduce,
        all_reduce_start=transport.all_reduce_start,
        device=device,
        max_grad_norm=update.max_grad_norm,
        on_nonfinite=update.on_nonfinite,
        lr_scheduler=update.lr_scheduler,
        precision=precision,
        step_optimizer=None if host is None else host.step,
    )
    weights = Weights(stages, optimizer, schedule.asynchronous, updater, sharing.reduce)
    runners = {
        index: Stage(
            index,
            weights,
            loss_fn,
            last=index == schedule.stages - 1,
            recompute=config.recompute,
            microbatches=schedule.microbatches,
            split_backward=schedule.split_backward,
            precision=precision,
            output_of=front.outputs,
        )
        for index in stages
    }
    recorder = Recorder(rank, device, enabled=runtime.record, mirrors=degree)
    unsharded = {s: m for s, m in stages.items() if s not in sharded}
    reducers: dict[int, Reducer] = {s: ShardedReducer(m) for s, m in sharded.items()}
    reducers.update(replica_reducers(unsharded, schedule, groups, device, runtime.bucket_bytes))
    defer_gloo_io_threads()  # the shared weights' and the replicas' groups started theirs
    mirror = mirrors is not None and not mirrors.leads
    cycle = UpdateCycle(
        weights, reducers, transport.all_reduce, device, per_update, mirror=mirror, host=host
    )
    executor = Executor(rank, runners, transport, cycle, recorder)
    return Rank(stages, transport, recorder, cycle, executor, sharing.names)


def _host_weights(schedule: Schedule, device: torch.device) -> HostWeights | None:
    """The host store of a schedule whose weights live there: stepping one update late
    under the ``stale`` option, else at once."""
    if not schedule.host_stored:
        return None
    return (StaleHostWeights if schedule.options.get("stale") else HostWeights)(device)
