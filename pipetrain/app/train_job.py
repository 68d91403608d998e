"""A training run of a built-in model, as ``pipetrain train`` does it.

:func:`run_training` checks the configuration, starts one local worker per stage with
:func:`pipetrain.launch` (or joins the process group that ``torchrun`` started), trains with
Adam, records a timeline of the last step, and compares it with the simulator's prediction
for the same schedule on the stage costs measured in that timeline.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, TextIO, TypeVar

import torch
import torch.distributed as dist

from pipetrain.app.data import BatchStream
from pipetrain.app.models import build_model, loss_function
from pipetrain.app.plan_job import plan_together
from pipetrain.model.layers import to_layers
from pipetrain.planning import Plan
from pipetrain.runtime import Pipeline, PipelineConfig, launch
from pipetrain.schedules import Schedule, spec
from pipetrain.simulation import Costs, measured_costs, simulate
from pipetrain.timeline import Timeline, format_seconds, plot_timelines

DEFAULT_LR = {"mlp": 3e-3, "uneven-mlp": 3e-3, "cnn": 3e-3, "gpt": 3e-3}
DEFAULT_BATCH_SIZE = {"mlp": 64, "uneven-mlp": 64, "cnn": 64, "gpt": 16}
DEFAULT_STAGES = 2
WARMUP_STEPS = 2  # left out of the median step time: first steps pay for allocation and set-up


@dataclass(frozen=True)
class TrainConfig:
    """What to train and how. ``None`` means the default (per model for ``batch_size`` and
    ``lr``; for ``stages``, 2 local workers or the torchrun world size). A ``plan`` sets the
    split, schedule and micro-batches, and its prediction is kept as ``planned_step_s``;
    ``plan_auto`` has the workers profile the model and plan it for ``stages`` workers first."""

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
    planned_step_s: float | None = None

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
        )

    def check(self) -> None:
        """Raise a ValueError naming the first setting that cannot run."""
        pipeline = self.pipeline_config()
        if self.replicas is not None and sum(self.replicas) != self.stages:
            raise ValueError(
                f"replicas {list(self.replicas)} add up to {sum(self.replicas)} workers, "
                f"but --stages is {self.stages}"
            )
        for name in ("microbatches", "steps", "batch_size", "threads"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}")
        if self.samples < self.microbatches:
            raise ValueError(
                f"batch size {self.batch_size} is smaller than microbatches {self.microbatches}; "
                f"use a batch of at least {self.microbatches}"
            )
        layers = len(to_layers(build_model(self.model, seed=self.seed)))
        pipeline.build(self.stages or DEFAULT_STAGES, layers)

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

    def schedule_for(self) -> Schedule:
        """The schedule this run executes (the one the Pipeline builds, before the targets'
        transfer is added)."""
        return self.pipeline_config().build(self.stages or DEFAULT_STAGES)


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


class Progress:
    """Prints ``step i/N, loss, samples/s`` on a stream: rewritten in place on a terminal,
    otherwise one line about every tenth of the run."""

    def __init__(self, steps: int, batch_size: int, stream: TextIO = sys.stderr) -> None:
        """Report on ``stream`` for a run of ``steps`` steps of ``batch_size`` samples."""
        self.steps, self.batch_size, self.stream = steps, batch_size, stream
        self.interactive = stream.isatty()
        self.every = 1 if self.interactive else max(1, steps // 10)
        self._last_step, self._last_time = 0, time.perf_counter()

    def update(self, step: int, loss: float) -> None:
        """Report that ``step`` (counted from 1) finished with ``loss``."""
        if step % self.every and step != self.steps:
            return
        now = time.perf_counter()
        rate = (step - self._last_step) * self.batch_size / max(now - self._last_time, 1e-9)
        self._last_step, self._last_time = step, now
        line = f"step {step}/{self.steps}  loss {loss:.4f}  {rate:,.0f} samples/s"
        self.stream.write(f"\r{line}\033[K" if self.interactive else line + "\n")
        if self.interactive and step == self.steps:
            self.stream.write("\n")
        self.stream.flush()


def train_worker(config: TrainConfig) -> dict[str, Any] | None:
    """Train on this rank of the process group; rank 0 returns the configuration it ran
    (with the plan's settings, for ``plan_auto``), losses, step times and the last step's
    timeline (as a dict), other ranks ``None``."""
    if config.plan_auto:
        if dist.get_rank() == 0:
            print(
                f"profiling {config.model} on {config.stages} workers at once, then planning ...",
                file=sys.stderr,
                flush=True,
            )
        # profile with the threads this worker trains with (torchrun's setting, under torchrun)
        chosen = plan_together(config.model, config.samples, config.seed, torch.get_num_threads())
        if dist.get_rank() == 0:
            print(chosen.describe() + "\n", file=sys.stderr, flush=True)
        config = replace(config, plan_auto=False, plan=chosen).resolved(dist.get_world_size())
    model = build_model(config.model, seed=config.seed)
    pipe = Pipeline(
        model,
        loss_fn=loss_function(config.model),
        optimizer=partial(torch.optim.Adam, lr=config.learning_rate),
        config=config.pipeline_config(),
    )
    # only the input stage's ranks load data; the targets travel to the last stage
    batches = (
        BatchStream(config.model, config.samples, seed=config.seed) if 0 in pipe.stages else None
    )
    progress = Progress(config.steps, config.samples) if pipe.rank == 0 else None
    losses: list[float] = []
    step_times: list[float] = []
    for step in range(config.steps):
        inputs, targets = next(batches) if batches is not None else (None, None)
        # recording costs a barrier per step, so only the last step is recorded
        pipe.recorder.enabled = step == config.steps - 1
        start = time.perf_counter()
        losses.append(pipe.train_step(inputs, targets))
        step_times.append(time.perf_counter() - start)
        if progress is not None:
            progress.update(step + 1, losses[-1])
    timeline = pipe.timeline()
    if timeline is None:
        return None
    return {
        "config": config,
        "losses": losses,
        "step_times_s": step_times,
        "timeline": timeline.to_dict(),
    }


def run_training(config: TrainConfig) -> TrainReport | None:
    """Train as ``config`` says and report; ``None`` on torchrun ranks other than 0.

    Under ``torchrun`` (``WORLD_SIZE`` set) it runs in this process on the existing process
    group (a gloo group is started if none is); otherwise it launches one local worker per
    stage with ``config.threads`` torch threads each.
    """
    if "WORLD_SIZE" in os.environ:
        started_group = not dist.is_initialized()
        if started_group:
            dist.init_process_group("gloo")
        try:
            config = config.resolved(world_size=dist.get_world_size())
            result = train_worker(config)
        finally:
            if started_group:
                dist.destroy_process_group()
    else:
        config = config.resolved()
        result = launch(train_worker, config.workers, config, threads_per_worker=config.threads)[0]
    return None if result is None else TrainReport.build(result["config"], result)


def _placement(config: TrainConfig) -> str:
    """``"2 stages"``, or ``"2 stages on 3 workers"`` when stages are replicated."""
    if config.replicas is None:
        return f"{config.stages} stages"
    replicas = ", ".join(map(str, config.replicas))
    return f"{len(config.replicas)} stages on {config.stages} workers (replicas {replicas})"


@dataclass(frozen=True)
class TrainReport:
    """The outcome of a run: losses and step times, and the last step measured and predicted."""

    config: TrainConfig
    losses: list[float]
    step_times_s: list[float]
    measured: Timeline
    predicted: Timeline
    costs: Costs

    @classmethod
    def build(cls, config: TrainConfig, result: dict[str, Any]) -> TrainReport:
        """Combine rank 0's result with the simulator's prediction on the measured costs."""
        measured = Timeline.from_dict(result["timeline"])
        schedule = config.schedule_for()
        costs = measured_costs(measured, schedule.stages)
        predicted = simulate(schedule, costs)
        return cls(config, result["losses"], result["step_times_s"], measured, predicted, costs)

    @property
    def step_s(self) -> float:
        """Median step time in seconds, leaving out the warm-up steps when there are more."""
        steady = self.step_times_s[WARMUP_STEPS:] or self.step_times_s
        return statistics.median(steady)

    @property
    def samples_per_s(self) -> float:
        """Training samples per second at the median step time."""
        return self.config.samples / self.step_s

    def to_json(self) -> dict[str, Any]:
        """The JSON object printed by ``pipetrain train --json``."""
        config = self.config
        return {
            "model": config.model,
            "schedule": config.schedule,
            "stages": config.stages,
            "microbatches": config.microbatches,
            "batch_size": config.batch_size,
            "steps": config.steps,
            "lr": config.lr,
            "losses": self.losses,
            "final_loss": self.losses[-1],
            "step_times_s": self.step_times_s,
            "step_s": self.step_s,
            "samples_per_s": self.samples_per_s,
            "bubble_fraction": self.measured.bubble_fraction,
            "recorded_step_s": self.measured.makespan,
            "predicted_step_s": self.predicted.makespan,
            "predicted_bubble_fraction": self.predicted.bubble_fraction,
            "planned_step_s": config.planned_step_s,
        }

    def summary(self) -> str:
        """A few readable lines: loss, step time, throughput, measured against predicted."""
        config, measured, predicted = self.config, self.measured, self.predicted
        steady = (
            f"steps {WARMUP_STEPS + 1}-{config.steps}"
            if config.steps > WARMUP_STEPS
            else "all steps"
        )
        per_micro = config.samples / config.microbatches
        stage_costs = " | ".join(
            f"{name} " + ", ".join(format_seconds(v) for v in getattr(self.costs, field))
            for name, field in (("F", "forward_s"), ("B", "backward_s"), ("W", "weight_s"))
            if any(getattr(self.costs, field))
        )
        planned = (
            []
            if config.planned_step_s is None
            else [
                (
                    f"  planned           {format_seconds(config.planned_step_s)} a step, "
                    f"{config.planned_step_s / self.step_s:.2f} × the median step "
                    "(the plan's prediction from the profile)"
                )
            ]
        )
        return "\n".join(
            [
                f"{config.model} on {_placement(config)}, {config.schedule}, "
                f"{config.microbatches} micro-batches "
                f"of {per_micro:g} samples, {config.steps} steps (Adam, lr {config.lr:g})",
                f"  loss              {self.losses[0]:.4f} -> {self.losses[-1]:.4f}",
                f"  step time         {format_seconds(self.step_s)} (median of {steady})",
                f"  throughput        {self.samples_per_s:,.0f} samples/s",
                f"  last step         measured {format_seconds(measured.makespan)}, "
                f"bubble {measured.bubble_fraction:.1%}",
                f"  predicted         {format_seconds(predicted.makespan)}, "
                f"bubble {predicted.bubble_fraction:.1%} "
                f"({config.schedule} simulated on the measured stage costs)",
                f"  stage costs       {stage_costs} (median per micro-batch, by stage)",
                *planned,
            ]
        )

    def write_trace(self, path: str) -> None:
        """Write the last step: a PNG of predicted above measured, or the measured Chrome trace."""
        name = self.config.schedule
        if path.lower().endswith(".png"):
            titles = [f"{name} predicted (measured costs)", f"{name} measured"]
            plot_timelines([self.predicted, self.measured], path, titles)
        else:
            self.measured.shifted().to_chrome_trace(path)
