"""What ``pipetrain train`` runs: :class:`TrainConfig`, holding the
:class:`~pipetrain.runtime.PipelineConfig` and :class:`~pipetrain.runtime.UpdateConfig` it
trains with, and the schedule it builds once."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

from pipetrain.app.arguments import check_saving
from pipetrain.app.corpus_stream import CorpusSettings
from pipetrain.app.data import BatchStream
from pipetrain.app.model_registry import model_spec
from pipetrain.planning import Plan
from pipetrain.profiler.lengths import LengthCosts
from pipetrain.runtime import PipelineConfig
from pipetrain.runtime.rank.update_config import UpdateConfig
from pipetrain.schedules import Schedule, with_targets_shipped
from pipetrain.units import counted

DEFAULT_RANKS = 2
WARMUP_STEPS = 2  # left out of the median step time: first steps pay for allocation and set-up
LR_SCHEDULES = ("constant", "warmup-cosine")
WARMUP_FRACTION = 0.1  # of the updates, for warmup-cosine


def _default_pipeline() -> PipelineConfig:
    # the targets travel from the input stage, so only its workers load data
    return PipelineConfig(microbatches=4, targets_on_first_stage=True)


@dataclass(frozen=True)
class TrainConfig:
    """What to train and how. ``pipeline`` holds the schedule's settings, ``update`` the
    clipping norm and precision. ``None`` means the default (per model for ``batch_size``
    and ``lr``; for ``ranks``, 2 local workers or the torchrun world size). A ``plan`` sets
    the split, schedule and micro-batches, and its prediction is kept as ``planned_step_s``
    (for the network ``planned_topology``); ``plan_auto`` has the workers profile the model,
    measure their links and plan it for ``ranks`` workers first, choosing among
    ``plan_schedules`` (``None``: every schedule) within ``plan_memory`` bytes a worker
    (``None``: no limit). Every ``accumulate`` steps (and the last)
    make one update. ``lr_schedule`` is ``"constant"`` or ``"warmup-cosine"`` (see
    :func:`warmup_cosine`); every ``eval_every`` steps the run evaluates the model on a
    fixed held-out batch. With ``save_dir``, the run saves a checkpoint every ``save_every``
    steps (a multiple of ``accumulate``) and at its last, keeping the ``keep_checkpoints``
    newest, and starts from the newest one there, whose saved settings must be the run's
    unless ``new_settings`` (see :mod:`pipetrain.app.run_settings`); every receive and
    collective waits at most ``timeout_s``. With ``data``, the built-in GPT trains on that
    corpus (see :mod:`pipetrain.app.corpus_stream`) with a token-mean loss, and a
    ``pipeline.microbatch_tokens`` budget forms each step's micro-batches; ``length_costs``
    (the GPT profiled at several lengths, filled in before the workers start) predicts each
    step, and with ``adaptive`` picks each step's formation. :meth:`resolved`
    fills the defaults in and builds ``schedule``, the schedule the run plays, once."""

    model: str
    pipeline: PipelineConfig = field(default_factory=_default_pipeline)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    ranks: int | None = None
    steps: int = 20
    batch_size: int | None = None
    lr: float | None = None
    seed: int = 0
    threads: int = 1
    plan: Plan | None = None
    plan_auto: bool = False
    plan_schedules: tuple[str, ...] | None = None
    plan_memory: float | None = None
    planned_step_s: float | None = None
    planned_topology: str | None = None
    accumulate: int = 1
    lr_schedule: str = "constant"
    eval_every: int | None = None
    save_dir: str | None = None
    save_every: int | None = None
    keep_checkpoints: int = 2
    timeout_s: float = 300.0
    schedule: Schedule | None = None
    new_settings: bool = False
    data: CorpusSettings | None = None
    adaptive: bool = False
    length_costs: LengthCosts | None = None

    def resolved(self, world_size: int | None = None) -> TrainConfig:
        """The configuration with defaults filled in, checked, and its schedule built;
        ValueError if it cannot run."""
        model = model_spec(self.model)
        if self.plan is not None and self.plan_auto:
            raise ValueError("give a plan or plan_auto=True, not both")
        if self.plan is not None:
            return replace(self.from_plan(self.plan), lr=self.lr or model.lr).resolved(world_size)
        replicas = self.pipeline.replicas
        ranks = (
            self.ranks
            or (sum(replicas) if replicas and not self.plan_auto else world_size)
            or DEFAULT_RANKS * self.pipeline.data_parallel * self.pipeline.tensor_parallel
        )
        if world_size is not None and ranks != world_size:
            raise ValueError(
                f"--ranks {ranks} differs from the torchrun world size {world_size}; "
                f"give --ranks {world_size} or omit it"
            )
        config = replace(
            self,
            ranks=ranks,
            batch_size=self.batch_size or model.batch_size,
            lr=self.lr or model.lr,
        )
        if self.plan_auto:  # an automatic plan is checked once the workers have made it
            return config
        return replace(config, schedule=config.checked())

    @property
    def workers(self) -> int:
        """The worker count of a resolved configuration."""
        return _resolved(self.ranks, "ranks")

    @property
    def samples(self) -> int:
        """The batch size of a resolved configuration."""
        return _resolved(self.batch_size, "batch_size")

    @property
    def learning_rate(self) -> float:
        """The learning rate of a resolved configuration."""
        return _resolved(self.lr, "lr")

    @property
    def built(self) -> Schedule:
        """The schedule a resolved configuration plays (without the targets' transfer)."""
        return _resolved(self.schedule, "schedule")

    def from_plan(self, plan: Plan) -> TrainConfig:
        """This configuration with the plan's split, replication, schedule and micro-batches;
        ValueError for a plan made for another model."""
        if plan.model and plan.model != self.model:
            raise ValueError(
                f"the plan was made for --model {plan.model}, not {self.model}; give "
                f"--model {plan.model}, or profile and plan {self.model} (or use --plan auto)"
            )
        return replace(
            self,
            plan=None,
            ranks=plan.ranks,
            # a corpus's targets of every length are read where the loss is
            pipeline=PipelineConfig.from_plan(plan, targets_on_first_stage=self.data is None),
            batch_size=self.batch_size or plan.batch_size,
            planned_step_s=plan.predicted_step_s
            if self.batch_size in (None, plan.batch_size)
            else None,
            planned_topology=plan.topology or None,
        )

    def checked(self) -> Schedule:
        """Check every setting and return the schedule the run plays; a ValueError names
        the first setting that cannot run."""
        replicas = self.pipeline.replicas
        if replicas is not None and sum(replicas) != self.ranks:
            raise ValueError(
                f"--replicas {','.join(map(str, replicas))} add up to "
                f"{counted(sum(replicas), 'rank')}, but --ranks is {self.ranks}; give --ranks "
                f"{sum(replicas)} or leave it out"
            )
        for name in ("steps", "batch_size", "threads", "accumulate"):
            value = getattr(self, name)
            if value < 1:
                flag = name.replace("_", "-")
                raise ValueError(f"--{flag} must be a positive integer, got {value}")
        microbatches = self.pipeline.microbatches
        if self.samples < microbatches:
            raise ValueError(
                f"--batch-size {self.batch_size} is smaller than --microbatches {microbatches}; "
                f"give --batch-size {microbatches} or more"
            )
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}"
            )
        if self.eval_every is not None and self.eval_every < 1:
            raise ValueError(f"--eval-every must be a positive integer, got {self.eval_every}")
        self._check_saving()
        if not self.timeout_s > 0:
            raise ValueError(
                f"--timeout must be a positive number of seconds, got {self.timeout_s}"
            )
        self._check_data()
        schedule = self.pipeline.build(self.workers, model_spec(self.model).layers)
        if schedule.asynchronous and self.accumulate > 1:
            raise ValueError(
                f"{schedule.name} updates each stage inside every step, so --accumulate needs "
                "a synchronous schedule"
            )
        # the Pipeline's own checks, before any worker starts
        self.update.check(schedule, True)
        return schedule

    def _check_data(self) -> None:
        """Raise a ValueError for data settings that cannot work."""
        if self.data is None:
            if self.adaptive:
                raise ValueError("--adaptive chooses how documents form micro-batches: give --data")
            if self.pipeline.microbatch_tokens is not None:
                raise ValueError(
                    "--microbatch-tokens forms micro-batches from documents of their own "
                    "lengths; give the corpus with --data"
                )
            # the data set must hold a batch (a plan may ask for more than it has)
            BatchStream(self.model, self.samples, seed=self.seed)
            return
        spec = model_spec(self.model)
        if not spec.text or spec.captured:
            raise ValueError(
                f"--data trains the built-in gpt (--model {self.model} "
                + ("is captured at one sequence length" if spec.captured else "reads images")
                + "); give --model gpt"
            )
        if self.adaptive and (self.data.pack or self.pipeline.microbatch_tokens is None):
            raise ValueError(
                "--adaptive changes the micro-batch count from step to step: give it "
                "--microbatch-tokens (the budget it varies) and leave out --pack"
            )
        if self.pipeline.targets_on_first_stage:
            raise ValueError(
                "data from --data reaches the last stage's ranks too (targets of every length "
                "are not sent as one tensor); build the pipeline with targets_on_first_stage "
                "off"
            )

    def _check_saving(self) -> None:
        """Raise a ValueError for save settings that cannot work."""
        check_saving(self.save_dir, self.save_every, self.accumulate, self.keep_checkpoints)

    def worker_pipeline(self) -> PipelineConfig:
        """The pipeline a worker trains with: the schedule built here, handed over as a
        value, with the split, recomputation, sharding and the targets' transfer. With a
        token budget the count changes from step to step: the family is given by name and
        the workers build the schedule of each count."""
        if self.pipeline.microbatch_tokens is not None:
            return self.pipeline
        return PipelineConfig(
            schedule=self.built,
            microbatches=self.built.microbatches,
            balance=self.pipeline.balance,
            recompute=self.pipeline.recompute,
            targets_on_first_stage=self.pipeline.targets_on_first_stage,
            shard=self.pipeline.shard,
            tensor_parallel=self.pipeline.tensor_parallel,
            tensor_parallel_plan=self.pipeline.tensor_parallel_plan,
        )

    def updates(self) -> int:
        """The updates a run makes: one per ``accumulate`` steps (and at the last), or, for
        an asynchronous schedule, every update it makes inside each step."""
        schedule = self.built
        if schedule.asynchronous:
            return self.steps * (schedule.microbatches // self.pipeline.per_update(schedule))
        return -(-self.steps // self.accumulate)

    def lr_factor(self) -> Callable[[int], float] | None:
        """The learning rate's factor at each update (``None``: constant)."""
        return None if self.lr_schedule == "constant" else warmup_cosine(self.updates())

    def schedule_for(self, microbatches: int | None = None) -> Schedule:
        """The schedule this run executes, the targets' transfer included, as the Pipeline
        plays it (so a simulation of it has the recorded timeline's actions); with a token
        budget, the one of a step of ``microbatches`` micro-batches."""
        built = self.built
        if microbatches is not None and microbatches != built.microbatches:
            counted_again = replace(self.pipeline, microbatches=microbatches)
            built = counted_again.build(self.workers, model_spec(self.model).layers)
        if not self.pipeline.targets_on_first_stage:
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
