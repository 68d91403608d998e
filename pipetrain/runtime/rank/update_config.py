"""What an update does beyond the optimizer's step, as a user sets it: :class:`UpdateConfig`,
checked against the schedule it will run under."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from pipetrain.runtime.rank.precision import LossScale, check_precision
from pipetrain.schedules import Kind, Schedule

NONFINITE_POLICIES = ("raise", "skip", "warn")

LRSchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
"""``lr_scheduler(optimizer) -> scheduler``, stepped once per applied update."""


def check_policy(max_grad_norm: float | None, on_nonfinite: str) -> None:
    """Raise ValueError for a clipping norm or a non-finite policy that cannot be used."""
    if on_nonfinite not in NONFINITE_POLICIES:
        raise ValueError(
            f"on_nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, got {on_nonfinite!r}"
        )
    if max_grad_norm is not None and not (
        isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0
    ):
        raise ValueError(f"max_grad_norm must be a positive number or None, got {max_grad_norm!r}")


@dataclass(frozen=True)
class UpdateConfig:
    """What every update does beyond the optimizer's step.

    ``max_grad_norm`` clips the gradients to that global norm before every update;
    ``lr_scheduler`` makes a learning-rate scheduler of the optimizer, stepped after every
    applied update; ``on_nonfinite`` is what an update whose loss or global gradient norm is
    not finite does (``"raise"``, ``"skip"``, or ``"warn"`` and skip); ``precision`` is
    ``"fp32"``, ``"bf16"`` or ``"fp16"`` (with the loss scale ``loss_scale``, GradScaler's
    defaults if ``None``). See :class:`~pipetrain.runtime.pipeline.Pipeline`.
    """

    max_grad_norm: float | None = None
    lr_scheduler: LRSchedulerFactory | None = None
    on_nonfinite: str = "raise"
    precision: str = "fp32"
    loss_scale: LossScale | None = None

    def including(self, max_grad_norm: float | None, precision: str) -> UpdateConfig:
        """These settings with ``max_grad_norm`` and ``precision`` given beside them (as
        :class:`~pipetrain.runtime.pipeline.Pipeline`'s own arguments); one given both ways
        with different values raises ValueError."""
        clashes = [
            name
            for name, value, held, default in (
                ("max_grad_norm", max_grad_norm, self.max_grad_norm, None),
                ("precision", precision, self.precision, "fp32"),
            )
            if value != default and held not in (default, value)
        ]
        if clashes:
            raise ValueError(f"{clashes[0]} given as an argument and in update=; give it once")
        return replace(
            self,
            max_grad_norm=self.max_grad_norm if max_grad_norm is None else max_grad_norm,
            precision=self.precision if precision == "fp32" else precision,
        )

    def check(self, schedule: Schedule, has_optimizer: bool) -> None:
        """Raise a ValueError naming the first setting that ``schedule`` (with an optimizer
        or not) cannot honour, and its fix."""
        check_policy(self.max_grad_norm, self.on_nonfinite)
        check_precision(self.precision)
        if not has_optimizer:
            settings = (
                ("max_grad_norm", self.max_grad_norm),
                ("lr_scheduler", self.lr_scheduler),
                ("precision='fp16'", True if self.precision == "fp16" else None),
            )
            given = [name for name, value in settings if value is not None]
            if given:
                raise ValueError(
                    f"{given[0]} acts at the pipeline's updates, which need an optimizer; pass "
                    "optimizer=... (or clip with pipe.clip_grad_norm_ before your own step)"
                )
        if not schedule.asynchronous:
            return
        if self.max_grad_norm is not None:
            _check_deferrable(schedule)
        if self.on_nonfinite != "raise":
            raise ValueError(
                f"{schedule.name} updates each stage at its own time, so the ranks cannot "
                f"skip an update together; on_nonfinite={self.on_nonfinite!r} needs a "
                "synchronous schedule (asynchronous ones raise)"
            )
        if self.precision == "fp16":
            raise ValueError(
                f"{schedule.name} updates each stage at its own time, so the ranks cannot skip "
                "an overflowing update together as fp16 loss scaling needs; use "
                "precision='bf16' (no loss scale) or a synchronous schedule"
            )


def _check_deferrable(schedule: Schedule) -> None:
    """Raise ValueError unless an asynchronous schedule's updates can wait for their global
    norm: one rank per stage, and every stage running each micro-batch on the same weight
    version, so that no forward needs an update before the input stage's backward of it."""
    if max(len(ranks) for ranks in schedule.stage_ranks) > 1:
        raise ValueError(
            f"max_grad_norm on {schedule.name} needs one rank per stage: replicas update "
            "on their own all-reduce, so no global norm exists at an update"
        )
    versions: dict[int | None, set[int | None]] = {}
    for lane in schedule.ranks:
        for action in lane:
            if action.kind is Kind.FORWARD:
                versions.setdefault(action.microbatch, set()).add(action.version)
    if any(len(used) > 1 for used in versions.values()):
        raise ValueError(
            f"max_grad_norm on {schedule.name} needs every stage to run a micro-batch on the "
            "same weight version (for pipedream: schedule_options={'vertical_sync': True}); "
            "otherwise a later stage needs each update before the global norm exists"
        )
