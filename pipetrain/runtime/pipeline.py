"""`Pipeline`: train a sequential model with pipeline parallelism, one stage per rank."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.model.layers import StageModule, check_balance, stage_bounds, to_layers
from pipetrain.runtime.executor import ActionFailed, Executor
from pipetrain.runtime.failure import explain_peer_failure, report_origin
from pipetrain.runtime.recompute import check_mode
from pipetrain.runtime.recorder import Recorder
from pipetrain.runtime.reduce import DEFAULT_BUCKET_BYTES, GradientReducer
from pipetrain.runtime.stash import WeightStash
from pipetrain.runtime.transport import PeerError, Transport
from pipetrain.schedules import SCHEDULE_NAMES, Kind, Schedule, build
from pipetrain.timeline import Timeline

if TYPE_CHECKING:
    from pipetrain.planning import Plan

OptimizerArg = (
    torch.optim.Optimizer | Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer] | None
)


def _split(value: torch.Tensor | Sequence[torch.Tensor], parts: int) -> list:
    """Split a tensor (or each tensor of a tuple) into ``parts`` pieces along dim 0."""
    if isinstance(value, torch.Tensor):
        return list(torch.tensor_split(value, parts))
    pieces = [torch.tensor_split(t, parts) for t in value]
    return [tuple(p[i] for p in pieces) for i in range(parts)]


def _batch_size(value: torch.Tensor | Sequence[torch.Tensor], what: str) -> int:
    tensor = value if isinstance(value, torch.Tensor) else value[0]
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        raise TypeError(
            f"{what} must be a tensor (or tuple of tensors) with a batch dimension, got {type(tensor).__name__}"
        )
    return tensor.shape[0]


def default_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device of this process: its local GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        return torch.device("cuda", local)
    return torch.device("cpu")


class Pipeline:
    """Train ``model`` split into stages over the ranks of a process group.

    Call it on every rank with the same arguments, inside an initialized
    ``torch.distributed`` process group (``torchrun``, or :func:`pipetrain.launch`). Each rank
    builds only its own stage(s). ``balance`` gives layers per stage (for ``interleaved``,
    ``ranks × virtual`` stages; by default layers are shared out evenly); ``plan`` takes
    balance, replicas, schedule, micro-batches and recomputation from a :class:`pipetrain.Plan`.
    ``replicas`` gives ranks per stage (``gpipe``, ``1f1b``, ``pipedream``). ``optimizer`` is
    an optimizer or a function from this rank's parameters to one; it is stepped once per
    :meth:`train_step`, or once per update for ``pipedream`` and ``2bw``. ``record=True`` records a measured timeline of
    every step (see :meth:`timeline`). With ``targets_on_first_stage=True`` the first
    stage's rank is given the targets too and sends them to the last stage, so only the
    input stage's ranks need to load data. A replicated stage all-reduces its gradients in
    buckets of up to ``bucket_bytes``, each started as soon as the update's last backward has
    produced it, so the transfer overlaps the rest of that backward. By default buckets are
    4 MiB on GPUs; on CPUs the whole stage is one bucket, because there the all-reduce's
    thread takes cores from the computation it would overlap.
    """

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        balance: Sequence[int] | None = None,
        microbatches: int = 1,
        schedule: str = "1f1b",
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        recompute: str = "never",
        optimizer: OptimizerArg = None,
        *,
        plan: Plan | None = None,
        replicas: Sequence[int] | None = None,
        virtual: int = 2,
        vertical_sync: bool = False,
        rounds: int = 2,
        targets_on_first_stage: bool = False,
        device: torch.device | str | None = None,
        group: dist.ProcessGroup | None = None,
        timeout_s: float = 300.0,
        record: bool = False,
        bucket_bytes: float | None = None,
    ) -> None:
        """Build this rank's stage(s), the schedule and the transport."""
        if not dist.is_initialized():
            raise RuntimeError(
                "Pipeline needs an initialized torch.distributed process group: run under torchrun, "
                "or start workers with pipetrain.launch(fn, nprocs=N)"
            )
        if loss_fn is None or not callable(loss_fn):
            raise TypeError(
                f"loss_fn must be a callable (output, target) -> mean loss, got {loss_fn!r}"
            )
        if plan is not None:
            if balance is not None:
                raise ValueError("give either balance or plan, not both")
            replicas = plan.replicas if any(r > 1 for r in plan.replicas) else None
            balance, schedule, microbatches, recompute = (
                plan.balance,
                plan.schedule,
                plan.microbatches,
                plan.recompute,
            )
            virtual = max(plan.virtual, 2) if schedule == "interleaved" else virtual
        if schedule not in SCHEDULE_NAMES:
            raise ValueError(
                f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULE_NAMES)}"
            )
        if schedule in ("pipedream", "2bw") and optimizer is None:
            raise ValueError(
                f"{schedule} updates the weights inside the step, so it needs an optimizer; pass optimizer=..."
            )
        self.recompute = check_mode(recompute)
        self.group = group
        self.rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        layers = to_layers(model)
        stages_per_rank = virtual if schedule == "interleaved" else 1
        if balance is None:
            balance = _even_balance(
                len(layers), len(replicas) if replicas is not None else world * stages_per_rank
            )
        self.balance = check_balance(balance, len(layers))
        options = {
            "interleaved": {"virtual": virtual},
            "pipedream": {"vertical_sync": vertical_sync},
            "2bw": {"rounds": rounds},
        }.get(schedule, {})
        if replicas is not None:
            replicas = list(replicas)
            if len(replicas) != len(self.balance) or sum(replicas) != world:
                raise ValueError(
                    f"replicas {replicas} must give one count per stage ({len(self.balance)}) and add up to the "
                    f"{world} ranks of the process group"
                )
            options["replicas"] = replicas
        elif len(self.balance) != world * stages_per_rank:
            raise ValueError(
                f"balance {self.balance} has {len(self.balance)} stages, but {schedule} on {world} ranks needs "
                f"{world * stages_per_rank}; give one entry per stage"
            )
        self.schedule: Schedule = build(
            schedule, len(self.balance) // stages_per_rank, microbatches, **options
        )
        self.microbatches = self.schedule.microbatches
        # micro-batches whose gradients make one update: all (synchronous), one (pipedream), m (2bw)
        self._per_update = {"pipedream": 1, "2bw": microbatches}.get(schedule, self.microbatches)
        self.device = torch.device(device) if device is not None else default_device(group)
        bounds = stage_bounds(self.balance)
        self.stages: dict[int, StageModule] = {
            stage: StageModule(layers[slice(*bounds[stage])]).to(self.device)
            for stage in self.schedule.stages_of(self.rank)
        }
        if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            # a stage of parameter-free layers (activations, pooling) has nothing to optimize
            optimizer = (
                optimizer(self.parameters()) if any(True for _ in self.parameters()) else None
            )
        self.optimizer = optimizer
        self.transport = Transport(self.device, group, timeout_s)
        # every rank creates every replica group, in the same order, as torch.distributed requires
        replica_groups = {
            stage: dist.new_group([self.transport.global_rank(r) for r in ranks])
            for stage, ranks in enumerate(self.schedule.stage_ranks)
            if len(ranks) > 1
        }
        if bucket_bytes is None:
            bucket_bytes = DEFAULT_BUCKET_BYTES if self.device.type == "cuda" else math.inf
        # synchronous replicas sum: their micro-batches make one mini-batch whose losses are
        # already weighted by their share; asynchronous ones average, as data parallelism does
        reducers = {
            stage: GradientReducer(
                [p for p in self.stages[stage].parameters() if p.requires_grad],
                group,
                len(self.schedule.stage_ranks[stage]),
                self.schedule.asynchronous,
                bucket_bytes,
            )
            for stage, group in replica_groups.items()
            if stage in self.stages
        }
        self.recorder = Recorder(self.rank, self.device, enabled=record)
        self._steps_taken = 0
        self.targets_on_first_stage = targets_on_first_stage
        stashes = (
            {stage: WeightStash(module) for stage, module in self.stages.items()}
            if self.schedule.asynchronous
            else None
        )
        self._executor = Executor(
            self.schedule,
            self.rank,
            dict(self.stages),
            self.transport,
            loss_fn,
            self.recompute,
            self.recorder,
            self._step,
            reducers,
            stashes,
        )

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
        # asynchronous schedules run on stashed snapshots: the loaded weights become the only version
        for stash in self._executor.stashes.values():
            stash.reset()

    # steps ----------------------------------------------------------------------------
    def _step(self, stage: int) -> None:
        self._steps_taken += 1
        # a synchronous step updates once all of this rank's stages are done; an asynchronous one at once
        if self.optimizer is not None and (
            self.schedule.asynchronous or self._steps_taken == len(self.stages)
        ):
            self.optimizer.step()

    def _holds(self, stage: int) -> bool:
        return stage in self.stages

    def _prepare(self, inputs, targets) -> tuple[list | None, list | None, list[float] | None]:
        m, last = self.microbatches, self.schedule.stages - 1
        micro_inputs = micro_targets = scales = None
        if self._holds(0):
            if inputs is None:
                raise ValueError(
                    f"rank {self.rank} holds the first stage and needs the inputs; got None"
                )
            size = _batch_size(inputs, "inputs")
            if size < m:
                raise ValueError(
                    f"batch of {size} samples is smaller than microbatches={m}; use a larger batch or fewer micro-batches"
                )
            micro_inputs = [p if isinstance(p, tuple) else (p,) for p in _split(inputs, m)]
            micro_inputs = [tuple(t.to(self.device) for t in p) for p in micro_inputs]
        if self._holds(last) and targets is not None:
            size = _batch_size(targets, "targets")
            if size < m:
                raise ValueError(
                    f"batch of {size} samples is smaller than microbatches={m}; use a larger batch or fewer micro-batches"
                )
            micro_targets = [
                t.to(self.device)
                if isinstance(t, torch.Tensor)
                else tuple(x.to(self.device) for x in t)
                for t in _split(targets, m)
            ]
            sizes = [_batch_size(t, "targets") for t in micro_targets]
            # each loss is weighted by its share of the samples of the update it belongs to
            update_sizes = [
                sum(sizes[k - k % self._per_update : k - k % self._per_update + self._per_update])
                for k in range(m)
            ]
            scales = [size_k / update_k for size_k, update_k in zip(sizes, update_sizes)]
        return micro_inputs, micro_targets, scales

    def _run(self, schedule: Schedule, micro_inputs, micro_targets, scales):
        if self.recorder.enabled:
            dist.barrier(group=self.group)
            self.recorder.reset()
        self._executor.schedule = schedule
        stage = min(self.stages)
        try:
            result = self._executor.run(micro_inputs, micro_targets, scales)
            self.transport.flush()
        except ActionFailed as error:
            raise report_origin(self.rank, error.stage, str(error)) from error
        except PeerError as error:
            raise explain_peer_failure(self.rank, stage, str(error)) from error
        except Exception as error:
            raise report_origin(
                self.rank,
                stage,
                f"rank {self.rank} (stage {stage}) failed: {type(error).__name__}: {error}",
            ) from error
        return result

    def train_step(self, inputs=None, targets=None) -> float:
        """Run one mini-batch through the schedule and return its mean loss (same float on every rank).

        Synchronous schedules leave each parameter's accumulated gradient in ``.grad`` as the
        unpipelined model would get from ``loss_fn(model(inputs), targets)``, and step the
        optimizer once if one was given. ``pipedream`` splits the batch into ``microbatches``
        mini-batches and updates after each one's backward (weight stashing); ``2bw`` runs
        ``rounds`` updates of ``microbatches`` micro-batches each. The pipeline drains at the
        end of the call; the loss returned is then the mean over updates. Only the first
        stage's rank reads ``inputs``, only the last's ``targets``.
        """
        last = self.schedule.stages - 1
        if self.targets_on_first_stage:
            targets = self._ship_targets(targets)
        if self._holds(last) and targets is None:
            raise ValueError(
                f"rank {self.rank} holds the last stage and needs the targets; got None"
            )
        micro_inputs, micro_targets, scales = self._prepare(inputs, targets)
        for parameter in self.parameters():
            parameter.grad = None
        self._steps_taken = 0
        loss = self._run(self.schedule, micro_inputs, micro_targets, scales)
        total = torch.zeros((), device=self.device)
        if loss is not None:
            total += loss
        dist.all_reduce(total, group=self.group)
        return float(total) * self._per_update / self.microbatches

    def _ship_targets(self, targets):
        """Send the targets from the first input-stage rank to every last-stage rank."""
        source, sinks = self.schedule.stage_ranks[0][0], self.schedule.stage_ranks[-1]
        if self.rank == source:
            if targets is None:
                raise ValueError(
                    f"rank {self.rank} holds the first stage and, with targets_on_first_stage, needs the targets; got None"
                )
            parts = (targets,) if isinstance(targets, torch.Tensor) else tuple(targets)
            for sink in sinks:
                if sink != source:
                    self.transport.send(tuple(t.to(self.device) for t in parts), sink, ("targets",))
            return targets
        if self.rank in sinks:
            try:
                parts = self.transport.receive(source, ("targets",))
            except PeerError as error:
                raise explain_peer_failure(self.rank, min(self.stages), str(error)) from error
            return parts[0] if len(parts) == 1 else parts
        return targets

    def eval_step(self, inputs=None) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
        """Forward only, without gradients: the model's output on the (first) last-stage rank,
        ``None`` elsewhere. The layers keep their mode: call ``model.eval()`` first for
        inference behaviour of dropout and batch normalization."""
        micro_inputs, _, _ = self._prepare(inputs, None)
        forward_only = _forward_only(self.schedule)
        with torch.no_grad():
            self._run(forward_only, micro_inputs, None, None)
        self._executor.schedule = self.schedule
        last = self.schedule.stage_ranks[-1]
        if self.rank not in last:
            return None
        # replicas of the last stage hold their own micro-batches: the first one gathers them
        if self.rank != last[0]:
            for k in sorted(self._executor.outputs):
                self.transport.send(self._executor.outputs[k], last[0], ("outputs",))
            self.transport.flush()
            return None
        pieces = [
            self._executor.outputs[k]
            if self.schedule.rank_of(self.schedule.stages - 1, k) == self.rank
            else self.transport.receive(
                self.schedule.rank_of(self.schedule.stages - 1, k), ("outputs",)
            )
            for k in range(self.microbatches)
        ]
        outputs = tuple(torch.cat(parts) for parts in zip(*pieces))
        return outputs[0] if len(outputs) == 1 else outputs

    def timeline(self) -> Timeline | None:
        """The last step's measured timeline, gathered on rank 0 (``None`` on other ranks).

        Every rank must call it. Needs ``record=True``.
        """
        if not self.recorder.enabled:
            raise RuntimeError("Pipeline(record=True) is needed to measure a timeline")
        gathered: list | None = [None] * dist.get_world_size(self.group) if self.rank == 0 else None
        dist.gather_object(
            self.recorder.events, gathered, dst=self.transport.global_rank(0), group=self.group
        )
        if self.rank != 0:
            return None
        timeline = Timeline(
            [e for events in gathered for e in events],
            len(gathered),
            label=f"{self.schedule.name} (measured)",
        )
        return timeline.shifted()


def _even_balance(layers: int, stages: int) -> list[int]:
    if layers < stages:
        raise ValueError(
            f"the model has {layers} layers, fewer than the {stages} stages needed; use fewer ranks"
        )
    return [layers // stages + (1 if i < layers % stages else 0) for i in range(stages)]


def _forward_only(schedule: Schedule) -> Schedule:
    """The forwards and their transfers only, on the newest weights."""
    keep = (Kind.FORWARD, Kind.SEND_F, Kind.RECV_F)
    ranks = tuple(
        tuple(a._replace(version=None) for a in actions if a.kind in keep)
        for actions in schedule.ranks
    )
    return replace(schedule, ranks=ranks, asynchronous=False)
