"""What ``pipetrain train`` runs: :class:`TrainConfig`, its defaults per built-in model, and
the :class:`~pipetrain.runtime.PipelineConfig` it trains with."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

from pipetrain.app.data import BatchStream
from pipetrain.app.models import model_layers
from pipetrain.planning import Plan
from pipetrain.runtime import PipelineConfig
from pipetrain.runtime.rank.update_config import UpdateConfig
from pipetrain.schedules import Schedule, spec, with_targets_shipped

DEFAULT_LR = {
    "mlp": 3e-3,
    "uneven-mlp": 3e-3,
    "cnn": 3e-3,
    "vgg": 1e-3,
    "gpt": 3e-3,
    "hf-gpt2": 3e-3,
    "hf-llama": 3e-3,
}
DEFAULT_BATCH_SIZE = {
    "mlp": 64,
    "uneven-mlp": 64,
    "cnn": 64,
    "vgg": 64,
    "gpt": 16,
    "hf-gpt2": 16,
    "hf-llama": 16,
}
DEFAULT_STAGES = 2
WARMUP_STEPS = 2  # left out of the median step time: first steps pay for allocation and set-up
LR_SCHEDULES = ("constant", "warmup-cosine")
WARMUP_FRACTION = 0.1  # of the updates, for warmup-cosine


@dataclass(frozen=True)
class TrainConfig:
    """What to train and how. ``None`` means the default (per model for ``batch_size`` and
    ``lr``; for ``stages``, 2 local workers or the torchrun world size). A ``plan`` sets the
    split, schedule and micro-batches, and its prediction is kept as ``planned_step_s`` (for
    the network ``planned_topology``);
    ``plan_auto`` has the workers profile the model, measure their links and plan it for
    ``stages`` workers first, choosing among ``plan_schedules`` (``None``: every schedule).
    Every ``accumulate`` steps (and the last) make one update, whose gradients are clipped
    to the global norm ``max_grad_norm`` if one is given. ``lr_schedule`` is ``"constant"``
    or ``"warmup-cosine"`` (see :func:`warmup_cosine`); every ``eval_every`` steps the run
    evaluates the model on a fixed held-out batch. ``precision`` is the Pipeline's
    (``"fp32"``, ``"bf16"`` or ``"fp16"``). With ``save_dir``, the run saves a checkpoint
    every ``save_every`` steps (a multiple of ``accumulate``) and at its last, keeping the
    ``keep_checkpoints`` newest, and starts from the newest one there; every receive and
    collective waits at most ``timeout_s``."""

    model: str
    stages: int | None = None
    schedule: str = "1f1b"
    microbatches: int = 4
    steps: int = 20
    batch_size: int | None = None
    balance: tuple[int, ...] | None = None
    recompute: str = "never"
    lr: float | None = None
    seed: int = 0
    threads: int = 1
    replicas: tuple[int, ...] | None = None
    schedule_options: dict[str, int | bool] = field(default_factory=dict)
    plan: Plan | None = None
    plan_auto: bool = False
    plan_schedules: tuple[str, ...] | None = None
    planned_step_s: float | None = None
    planned_topology: str | None = None
    accumulate: int = 1
    max_grad_norm: float | None = None
    lr_schedule: str = "constant"
    eval_every: int | None = None
    precision: str = "fp32"
    save_dir: str | None = None
    save_every: int | None = None
    keep_checkpoints: int = 2
    timeout_s: float = 300.0

    def resolved(self, world_size: int | None = None) -> TrainConfig:
        """The configuration with defaults filled in and checked; ValueError if it cannot run."""
        if self.model not in DEFAULT_LR:
            raise ValueError(f"unknown model {self.model!r}; choose one of {', '.join(DEFAULT_LR)}")
        if self.plan is not None and self.plan_auto:
            raise ValueError("give a plan or plan_auto=True, not both")
        if self.plan is not None:
            return replace(
                self.from_plan(self.plan), lr=self.lr or DEFAULT_LR[self.model]
            ).resolved(world_size)
        stages = (
            self.stages
            or (sum(self.replicas) if self.replicas and not self.plan_auto else world_size)
            or DEFAULT_STAGES
        )
        if world_size is not None and stages != world_size:
            raise ValueError(
                f"stages {stages} differs from the torchrun world size {world_size}; "
                f"give --stages {world_size} or omit it"
            )
        config = replace(
            self,
            stages=stages,
            batch_size=self.batch_size or DEFAULT_BATCH_SIZE[self.model],
            lr=self.lr or DEFAULT_LR[self.model],
        )
        if not self.plan_auto:  # an automatic plan is checked once the workers have made it
            config.check()
        return config

    @property
    def workers(self) -> int:
        """The worker count of a resolved configuration."""
        return _resolved(self.stages, "stages")

    @property
    def samples(self) -> int:
        """The batch size of a resolved configuration."""
        return _resolved(self.batch_size, "batch_size")

    @property
    def learning_rate(self) -> float:
        """The learning rate of a resolved configuration."""
        return _resolved(self.lr, "lr")

    def from_plan(self, plan: Plan) -> TrainConfig:
        """This configuration with the plan's split, replication, schedule and micro-batches."""
        replicas = tuple(plan.replicas) if max(plan.replicas) > 1 else None
        return replace(
            self,
            plan=None,
            stages=plan.workers,
            schedule=plan.schedule,
            microbatches=plan.microbatches,
            balance=tuple(plan.balance),
            replicas=replicas,
            recompute=plan.recompute,
            schedule_options=plan_options(plan),
            batch_size=self.batch_size or plan.batch_size,
            planned_step_s=plan.predicted_step_s
            if self.batch_size in (None, plan.batch_size)
            else None,
            planned_topology=plan.topology or None,
        )

    def check(self) -> None:
        """Raise a ValueError naming the first setting that cannot run."""
        pipeline = self.pipeline_config()
        if self.replicas is not None and sum(self.replicas) != self.stages:
            raise ValueError(
                f"replicas {list(self.replicas)} add up to {sum(self.replicas)} workers, "
                f"but --stages is {self.stages}"
            )
        for name in ("microbatches", "steps", "batch_size", "threads", "accumulate"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}")
        if self.samples < self.microbatches:
            raise ValueError(
                f"batch size {self.batch_size} is smaller than microbatches {self.microbatches}; "
                f"use a batch of at least {self.microbatches}"
            )
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}"
            )
        if self.eval_every is not None and self.eval_every < 1:
            raise ValueError(f"eval_every must be a positive integer, got {self.eval_every}")
        self._check_saving()
        if not self.timeout_s > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout_s}")
        # the data set must hold a batch (a plan may ask for more than it has)
        BatchStream(self.model, self.samples, seed=self.seed)
        layers = model_layers(self.model, self.seed)
        schedule = pipeline.build(self.stages or DEFAULT_STAGES, layers)
        if schedule.asynchronous and self.accumulate > 1:
            raise ValueError(
                f"{schedule.name} updates each stage inside every step, so --accumulate needs "
                "a synchronous schedule"
            )
        # the Pipeline's own checks, before any worker starts
        UpdateConfig(self.max_grad_norm, precision=self.precision).check(schedule, True)

    def _check_saving(self) -> None:
        """Raise a ValueError for save settings that cannot work."""
        if self.save_every is not None and self.save_dir is None:
            raise ValueError("save_every needs a save directory (--save-dir)")
        if self.save_every is not None and (
            self.save_every < 1 or self.save_every % self.accumulate
        ):
            raise ValueError(
                f"save_every {self.save_every} must be a positive multiple of accumulate "
                f"{self.accumulate}: a checkpoint is taken after an update"
            )
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be at least 1, got {self.keep_checkpoints}")

    def pipeline_config(self) -> PipelineConfig:
        """The pipeline this run trains with; the targets travel from the input stage, so
        only its workers load data."""
        return PipelineConfig(
            schedule=self.schedule,
            microbatches=self.microbatches,
            schedule_options=dict(self.schedule_options),
            replicas=self.replicas,
            balance=self.balance,
            recompute=self.recompute,
            targets_on_first_stage=True,
        )

    def updates(self) -> int:
        """The updates a run makes: one per ``accumulate`` steps (and at the last), or, for
        an asynchronous schedule, every update it makes inside each step."""
        pipeline = self.pipeline_config()
        layers = model_layers(self.model, self.seed)
        schedule = pipeline.build(self.stages or DEFAULT_STAGES, layers)
        if schedule.asynchronous:
            return self.steps * (schedule.microbatches // pipeline.per_update(schedule))
        return -(-self.steps // self.accumulate)

    def lr_factor(self) -> Callable[[int], float] | None:
        """The learning rate's factor at each update (``None``: constant)."""
        return None if self.lr_schedule == "constant" else warmup_cosine(self.updates())

    def schedule_for(self) -> Schedule:
        """The schedule this run executes, the targets' transfer included, as the Pipeline
        plays it (so a simulation of it has the recorded timeline's actions)."""
        pipeline = self.pipeline_config()
        built = pipeline.build(self.stages or DEFAULT_STAGES)
        if not pipeline.targets_on_first_stage:
            return built
        return replace(built, ranks=with_targets_shipped(built.ranks, built.stage_ranks))


def warmup_cosine(updates: int) -> Callable[[int], float]:
    """The factor of the learning rate at each of ``updates`` updates: a linear warm-up over
    the first 10% of them (at least one), then a cosine decay that reaches 0 after the last."""
    warmup = max(1, round(WARMUP_FRACTION * updates))

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        progress = min(1.0, (update - warmup) / max(1, updates - warmup))
        return 0.5 * (1 + math.cos(math.pi * progress))

    return factor


T = TypeVar("T")


def _resolved(value: T | None, name: str) -> T:
    if value is None:
        raise RuntimeError(f"TrainConfig.{name} is set by resolved(); call it first")
    return value


def plan_options(plan: Plan) -> dict[str, int | bool]:
    """The schedule options a plan implies: its chunks per worker, for a family that has
    several model chunks per rank."""
    chunk_option = spec(plan.schedule).chunk_option
    return {chunk_option: plan.virtual} if chunk_option is not None and plan.virtual > 1 else {}
