"""What a pipeline run is, apart from the model, its loss and its optimizer.

:class:`PipelineConfig` holds the schedule (a registered family's name, or a built or
hand-written :class:`~pipetrain.schedules.Schedule`), its options and placement, the split
of layers into stages, recomputation and the runtime's settings. Every fact about a
schedule family comes from its spec (:func:`pipetrain.schedules.spec`); a schedule value
speaks for itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pipetrain.checks import positive_int
from pipetrain.model.capture import Inputs
from pipetrain.model.layers import check_balance
from pipetrain.model.materialize import InitFn
from pipetrain.model.weights_source import WeightsArg
from pipetrain.planning.host_store import STAGES_OPTION
from pipetrain.runtime.rank.recompute import check_mode
from pipetrain.runtime.rank.tensor_parallel import check_mirrorable, schedule_ranks
from pipetrain.schedules import Kind, Schedule, ScheduleSpec, build, spec, validate
from pipetrain.schedules.copies import data_parallel_copies
from pipetrain.schedules.gathers import with_gathers

if TYPE_CHECKING:
    from pipetrain.planning import Plan

_PLANNED = (
    "schedule",
    "microbatches",
    "schedule_options",
    "replicas",
    "balance",
    "recompute",
    "shard",
)


def _counts(value: Sequence[int] | None) -> Sequence[int] | None:
    """A list of counts as a tuple; anything else as given, for the checks to name."""
    return tuple(value) if isinstance(value, (list, tuple)) else value


@dataclass(frozen=True)
class PipelineConfig:
    """The settings of a pipeline run (see :class:`~pipetrain.runtime.pipeline.Pipeline`).

    ``schedule`` is a registered family's name or a :class:`~pipetrain.schedules.Schedule`
    value; ``schedule_options`` are the family's own (``{"virtual": 2}`` for
    ``interleaved``). ``microbatches`` counts micro-batches per update for a name; a
    schedule value runs its own. ``replicas`` gives ranks per stage (replicable families),
    ``balance`` layers per stage (by default shared out evenly). ``microbatch_tokens``:
    each training step given as :class:`~pipetrain.runtime.token_budget.Sequences` is cut
    into micro-batches of at most this many tokens (rows x their longest), so the count
    follows the step's lengths; the schedule for each count is built on its first step
    and kept (synchronous families; ``microbatches`` is then only the first schedule's).
    ``tensor_parallel``: each rank of the schedule is played by this many consecutive
    processes, each holding a part of every stage's linear layers split as
    ``tensor_parallel_plan`` and the layers' own plans say (see
    :mod:`pipetrain.runtime.rank.tensor_parallel`).
    """

    schedule: str | Schedule = "1f1b"
    microbatches: int = 1
    schedule_options: Mapping[str, int | bool] = field(default_factory=dict)
    replicas: Sequence[int] | None = None
    balance: Sequence[int] | None = None
    recompute: str = "never"
    targets_on_first_stage: bool = False
    data_parallel: int = 1
    shard: bool = False
    microbatch_tokens: int | None = None
    tensor_parallel: int = 1
    tensor_parallel_plan: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Keep copies of the mutable settings, so the value stays as it was built."""
        object.__setattr__(self, "schedule_options", dict(self.schedule_options))
        object.__setattr__(self, "tensor_parallel_plan", dict(self.tensor_parallel_plan))
        object.__setattr__(self, "replicas", _counts(self.replicas))
        object.__setattr__(self, "balance", _counts(self.balance))

    @classmethod
    def from_plan(cls, plan: Plan, **overrides: Any) -> PipelineConfig:
        """The split, replication (whole or sharded), schedule, micro-batches and
        recomputation of ``plan``, with ``overrides`` (any other field) on top."""
        family = spec(plan.schedule)
        options: dict[str, object] = {}
        if family.host_weights:  # its stages are dealt, not given per rank
            options[STAGES_OPTION] = len(plan.stages)
        elif family.chunk_option is not None and plan.virtual > 1:
            options[family.chunk_option] = plan.virtual
        settings: dict[str, Any] = {
            "schedule": plan.schedule,
            "microbatches": plan.microbatches,
            "schedule_options": options,
            "replicas": tuple(plan.replicas) if max(plan.replicas) > 1 else None,
            "balance": tuple(plan.balance),
            "recompute": plan.recompute,
            "shard": plan.shard,
        }
        return cls(**{**settings, **overrides})

    @classmethod
    def from_arguments(
        cls, config: PipelineConfig | None, plan: Plan | None, **settings: Any
    ) -> PipelineConfig:
        """The configuration that :class:`Pipeline`'s arguments describe: ``config`` as given,
        else ``plan``'s with the other ``settings``, else ``settings``; a setting given
        beside a ``config`` or a plan that sets it raises ValueError."""
        defaults = {f.name: f.default for f in fields(cls)}
        given = sorted(name for name, value in settings.items() if value != defaults[name])
        if config is not None:
            if plan is not None:
                raise ValueError(
                    "give either config or plan, not both; PipelineConfig.from_plan(plan) makes "
                    "a configuration of a plan"
                )
            if given:
                raise ValueError(
                    f"config= holds every setting; give {', '.join(given)} inside it instead"
                )
            return config
        if plan is None:
            return cls(**settings)
        planned = [name for name in given if name in _PLANNED]
        if planned:
            raise ValueError(
                f"the plan sets {', '.join(planned)}; give either plan or {planned[0]}, not both"
            )
        return cls.from_plan(plan, **{name: settings[name] for name in given})

    def rank_of(self, process: int) -> int:
        """The schedule rank that ``process`` (of the pipeline's group) plays."""
        return process // self.tensor_parallel

    @property
    def family(self) -> ScheduleSpec | None:
        """The spec of the schedule's family; ``None`` for a schedule value."""
        return None if isinstance(self.schedule, Schedule) else spec(self.schedule)

    def build(self, world: int, layers: int | None = None, has_optimizer: bool = True) -> Schedule:
        """Check this configuration for ``world`` processes (and a model of ``layers``
        layers) and return the schedule it runs, of ``world / tensor_parallel`` ranks; a
        ValueError names the first setting that cannot run and how to fix it."""
        check_mode(self.recompute)
        world = schedule_ranks(world, self.tensor_parallel)
        if isinstance(self.schedule, Schedule):
            schedule = self._checked_value(self.schedule, world)
            self._check_balance(schedule.stages, layers, f"the given schedule on {world} ranks")
        else:
            schedule = self._built(spec(self.schedule), world, layers)
        if schedule.asynchronous and not has_optimizer:
            raise ValueError(
                f"{schedule.name} updates the weights inside the step, so it needs an "
                "optimizer; pass optimizer=..."
            )
        tokens = self.microbatch_tokens is not None
        check_mirrorable(self.tensor_parallel, schedule.asynchronous, tokens)
        if self.shard:
            _check_shardable(schedule)
            schedule = with_gathers(schedule)
        if self.microbatch_tokens is not None:
            self._check_token_budget(schedule)
        if schedule.host_stored:
            _check_host_stored(schedule, self.tensor_parallel)
        return schedule

    def _check_token_budget(self, schedule: Schedule) -> None:
        positive_int("microbatch_tokens", self.microbatch_tokens)
        fixed = {
            "an asynchronous schedule": schedule.asynchronous,
            "a Schedule value": isinstance(self.schedule, Schedule),
            "recompute='except_last'": self.recompute == "except_last",
            "targets_on_first_stage": self.targets_on_first_stage,
        }
        refused = [what for what, given in fixed.items() if given]
        if refused:
            raise ValueError(
                f"microbatch_tokens changes the micro-batch count from step to step, which "
                f"{refused[0]} cannot follow; use a synchronous family by name without it"
            )

    def _built(self, family: ScheduleSpec, world: int, layers: int | None) -> Schedule:
        positive_int("microbatches", self.microbatches)
        options = family.resolve(self.schedule_options)
        replicas = None if self.replicas is None else list(self.replicas)
        if self.data_parallel != 1 and (not family.replicable or family.chunks(options) != 1):
            return self._copied(family, world, layers, options)
        if self.data_parallel != 1:
            replicas = self._data_parallel_replicas(family, world, options)
        if replicas is None and family.host_weights:  # its stage count is an option's
            built = build(family.name, world, self.microbatches, replicas=None, **options)
            self._check_balance(built.stages, layers, f"{family.name} on {world} ranks")
            return built
        if replicas is None:
            stages = world * family.chunks(options)
            self._check_balance(stages, layers, f"{family.name} on {world} ranks")
        else:
            stages = len(self.balance) if self.balance is not None else len(replicas)
            self._check_balance(stages, layers, f"{family.name} with replicas {replicas}")
            if len(replicas) != stages or sum(replicas) != world:
                raise ValueError(
                    f"replicas {replicas} must give one count per stage ({stages}) and add up "
                    f"to the {world} ranks of the process group"
                )
        return build(family.name, world, self.microbatches, replicas=replicas, **options)

    def _copied(
        self,
        family: ScheduleSpec,
        world: int,
        layers: int | None,
        options: Mapping[str, int | bool],
    ) -> Schedule:
        """``data_parallel`` copies of ``family``'s pipeline side by side, each on its share
        of the ranks and of the micro-batches, for a family that does not replicate stages
        inside its schedule (see :mod:`pipetrain.schedules.copies`)."""
        dp = positive_int("data_parallel", self.data_parallel)
        if self.replicas is not None or world % dp or self.microbatches % dp:
            raise ValueError(
                f"data_parallel={dp} runs {dp} copies of a {family.name} pipeline, each on "
                f"1/{dp} of the ranks and of the micro-batches: give a world size and "
                f"microbatches that {dp} divides (not {world} and {self.microbatches}), and "
                "no replicas"
            )
        pipeline = build(
            family.name, world // dp, self.microbatches // dp, replicas=None, **options
        )
        self._check_balance(pipeline.stages, layers, f"{family.name} on {world // dp} ranks")
        return data_parallel_copies(pipeline, dp)

    def _data_parallel_replicas(
        self, family: ScheduleSpec, world: int, options: Mapping[str, int | bool]
    ) -> list[int]:
        """``data_parallel`` ranks for every stage of the ``world`` ranks."""
        dp = positive_int("data_parallel", self.data_parallel)
        if self.replicas is not None:
            raise ValueError(
                f"data_parallel={dp} gives every stage {dp} replicas; leave replicas out (or "
                "give replicas alone for stages replicated unevenly)"
            )
        if world % dp or family.chunks(options) != 1:
            raise ValueError(
                f"data_parallel={dp} needs the {world} ranks to hold whole copies of a "
                f"pipeline of {family.name}: give a world size that {dp} divides, and a family "
                "with one stage per rank (gpipe, 1f1b, pipedream)"
            )
        return [dp] * (world // dp)

    def _check_balance(self, stages: int, layers: int | None, what: str) -> None:
        if self.balance is None:
            if layers is not None and layers < stages:
                raise ValueError(
                    f"the model has {layers} layers, fewer than the {stages} stages of {what}; "
                    "use fewer ranks"
                )
            return
        balance = list(self.balance)
        if layers is not None:
            check_balance(balance, layers)
        if len(balance) != stages:
            raise ValueError(
                f"balance {balance} has {len(balance)} stages, but {what} needs {stages}; "
                "give one entry per stage"
            )

    def _checked_value(self, schedule: Schedule, world: int) -> Schedule:
        if self.schedule_options or self.replicas is not None or self.data_parallel != 1:
            raise ValueError(
                "a Schedule value carries its own options and placement; leave "
                "schedule_options, replicas and data_parallel out"
            )
        if self.microbatches not in (1, schedule.microbatches):
            raise ValueError(
                f"microbatches={self.microbatches}, but the given schedule runs "
                f"{schedule.microbatches}; leave microbatches out"
            )
        if schedule.num_ranks != world:
            raise ValueError(
                f"the given schedule has {schedule.num_ranks} ranks, but the process group has "
                f"{world}; write one lane per rank"
            )
        if any(all(a.kind is not Kind.LOSS for a in lane) for lane in schedule.ranks):
            raise ValueError(
                "the given schedule has no closing LOSS on every rank, so it was not lowered; "
                "build it with pipetrain.schedules.lower (or read it with Schedule.from_text)"
            )
        validate(schedule)
        return schedule

    def balance_for(self, layers: int, schedule: Schedule) -> list[int]:
        """Layers per stage: the configured balance, or ``layers`` shared out evenly."""
        if self.balance is not None:
            return check_balance(list(self.balance), layers)
        stages = schedule.stages
        return [layers // stages + (1 if i < layers % stages else 0) for i in range(stages)]

    def per_update(self, schedule: Schedule) -> int:
        """Micro-batches whose gradients make one update (all of them when synchronous)."""
        family = self.family
        if family is not None:
            return family.per_update(self.microbatches, family.resolve(self.schedule_options))
        if not schedule.asynchronous:
            return schedule.microbatches
        # a written schedule: the last stage's backwards before its first update
        last = schedule.stages - 1
        count = 0
        for action in schedule.ranks[schedule.stage_ranks[last][0]]:
            if action.stage == last and action.kind is Kind.BACKWARD:
                count += 1
            elif action.stage == last and action.kind is Kind.STEP:
                break
        return count


def _check_shardable(schedule: Schedule) -> None:
    """Raise ValueError unless ``schedule`` can shard its replicated stages."""
    replicas = max(len(ranks) for ranks in schedule.stage_ranks)
    if replicas < 2:
        raise ValueError(
            "shard=True shards each stage over its replicas, and no stage has any: give "
            "data_parallel=N (or replicas) too"
        )
    if schedule.asynchronous:
        raise ValueError(
            f"shard=True runs synchronous schedules; {schedule.name} updates inside the step"
        )
    if schedule.microbatches < replicas:
        raise ValueError(
            f"shard=True needs every replica to run a micro-batch: give at least {replicas} "
            f"micro-batches, not {schedule.microbatches}"
        )


@dataclass(frozen=True)
class RuntimeConfig:
    """Where and how a rank runs (see :class:`~pipetrain.runtime.pipeline.Pipeline`).

    ``device``: where this rank computes (by default its GPU under NCCL, else the CPU).
    ``group``: the process group (the default one if ``None``). ``timeout_s``: how long any
    transfer, and the loss and gradient-norm all-reduces, may wait; the other collectives
    wait as long as the process group's timeout. ``frozen_after_s``: a peer whose heartbeat
    has stood still this long is named as frozen (its process stopped or hung) or
    unreachable (on another host) (gloo; see :mod:`pipetrain.distributed.heartbeat`); by
    default ``timeout_s``, so a stall the timeout allows is waited for, each wait on the
    rank's own thread (a shorter threshold hands every wait to a watching thread: two
    thread switches a message). ``record``: record a
    measured timeline of every step. ``bucket_bytes``: a replicated stage all-reduces its
    gradients in buckets of up to this size, each started as soon as the update's last
    backward produced it (by default 4 MiB on GPUs and the whole stage on CPUs).
    """

    device: torch.device | str | None = None
    group: Any = None
    timeout_s: float = 300.0
    record: bool = False
    bucket_bytes: float | None = None
    frozen_after_s: float | None = None

    def check(self) -> None:
        """Raise RuntimeError without a process group to run in, ValueError for a timeout or
        bucket size that cannot be used."""
        if not dist.is_initialized():
            raise RuntimeError(
                "Pipeline needs an initialized torch.distributed process group: run under "
                "torchrun, or start workers with pipetrain.launch(fn, nprocs=N)"
            )
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number, got {self.timeout_s!r}")
        frozen = self.frozen_after_s
        if frozen is not None and not (isinstance(frozen, (int, float)) and frozen > 0):
            raise ValueError(f"frozen_after_s must be a positive number, got {frozen!r}")
        if self.bucket_bytes is not None and not self.bucket_bytes > 0:
            raise ValueError(f"bucket_bytes must be positive, got {self.bucket_bytes!r}")


@dataclass(frozen=True)
class ModelSource:
    """Where a pipeline's stage modules come from, beyond the model itself.

    ``example_inputs``: a sample of a captured model's inputs with at least 2 rows (a
    tensor, tuple, or dict of keyword inputs); the steps' inputs are then given the same
    way. ``init_fn``: initializes a stage module's tensors in place, for a model built on
    the meta device (by default each module's ``reset_parameters()``; see
    :func:`~pipetrain.model.materialize.materialize`). ``weights``: the initial weights, a
    state dict keyed by the full model's names or the path of a ``.safetensors`` file or a
    ``torch.save``d state dict; each rank reads only its stages' entries. With
    ``deferred_batch_norm``, batch-normalization layers update their running statistics
    once per step from the whole mini-batch (models given as layers, synchronous families,
    no replicas; see :mod:`pipetrain.runtime.rank.batchnorm`).
    """

    example_inputs: Inputs | None = None
    init_fn: InitFn | None = None
    weights: WeightsArg | None = None
    deferred_batch_norm: bool = False


def _check_host_stored(schedule: Schedule, tensor_parallel: int) -> None:
    """A ValueError for what a schedule whose weights live in a host store (``LOAD``/
    ``OFFLOAD``) cannot run: each rank keeps the stages it loads in a store of its own, so
    a stage runs on one rank, synchronously, whole."""
    replicated = [s for s, ranks in enumerate(schedule.stage_ranks) if len(ranks) > 1]
    refused = {
        "asynchronous updates": schedule.asynchronous,
        f"tensor_parallel={tensor_parallel}": tensor_parallel > 1,
    }
    if replicated:
        ranks = list(schedule.stage_ranks[replicated[0]][:4])
        refused[f"stage {replicated[0]} on ranks {ranks}"] = True
    for what, given in refused.items():
        if given:
            raise ValueError(
                f"{schedule.name} keeps each stage's weights in the host store of the one rank "
                f"that loads it, synchronously and whole, so it cannot run {what}; give no "
                "replicas, data_parallel or tensor_parallel, or use another family"
            )
