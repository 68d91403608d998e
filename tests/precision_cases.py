"""Worker functions for the mixed-precision tests (importable by spawned workers), and the
unpipelined autocast loop with :class:`torch.amp.GradScaler` they are compared with."""

from __future__ import annotations

from typing import Any

import torch
from pipeline_cases import batch, mlp
from settings import make_pipeline
from torch import nn
from training_cases import MAX_NORM, adamw, loop_pipeline, scheduler

from pipetrain.runtime.rank.precision import LossScale

UPDATES, BATCH = 8, 8
# starts far too high and grows fast, so that updates overflow, back off, grow and
# overflow again
LOSS_SCALE = LossScale(
    init_scale=2.0**40, growth_factor=2.0**8, backoff_factor=2.0**-8, growth_interval=2
)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every update's mini-batch."""
    return [batch(seed=40 + k, size=BATCH) for k in range(UPDATES)]


def grad_scaler(enabled: bool = True) -> torch.amp.GradScaler:
    """torch's GradScaler on the pipelines' loss-scale policy, :data:`LOSS_SCALE`."""
    policy = LOSS_SCALE
    return torch.amp.GradScaler(
        "cpu",
        init_scale=policy.init_scale,
        growth_factor=policy.growth_factor,
        backoff_factor=policy.backoff_factor,
        growth_interval=policy.growth_interval,
        enabled=enabled,
    )


def scaled_steps(pipe: Any) -> tuple[list[float], list[bool], list[float]]:
    """A pipeline's steps on :func:`data`: each loss, whether its update was skipped, and
    the loss scale after it."""
    losses, skipped, scales = [], [], []
    for x, y in data():
        before = pipe.skipped_updates
        losses.append(pipe.train_step(x, y))
        skipped.append(pipe.skipped_updates > before)
        scales.append(pipe.precision.scale)
    return losses, skipped, scales


def reference_loop(precision: str, microbatches: int) -> dict[str, Any]:
    """The unpipelined loop on the pipeline's micro-batches: autocast forwards, float32
    losses weighted by their share of the batch, GradScaler for fp16 (unscale, clip, step,
    update; the learning-rate schedule steps at applied updates only)."""
    model = mlp()
    optimizer = adamw(model.parameters())
    schedule = scheduler(optimizer)
    scaler = grad_scaler(enabled=precision == "fp16")
    losses, skipped, scales = [], [], []
    for x, y in data():
        optimizer.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
            with torch.autocast("cpu", dtype=DTYPES[precision]):
                loss = nn.functional.cross_entropy(model(xs), ys)
            loss = loss.float() * (len(xs) / len(x))
            scaler.scale(loss).backward()
            total += loss.item()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        overflowed = scaler.get_scale() < before
        if not overflowed:
            schedule.step()
        losses.append(total)
        skipped.append(overflowed)
        scales.append(scaler.get_scale())
    return {"losses": losses, "skipped": skipped, "scales": scales, "state": model.state_dict()}


def pipelined_loop(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The loop of :func:`reference_loop` on a pipeline per config (each with its
    ``precision``)."""
    results = []
    for config in configs:
        pipe = loop_pipeline(loss_scale=LOSS_SCALE, **config)
        losses, skipped, scales = scaled_steps(pipe)
        results.append(
            {
                "losses": losses,
                "skipped": skipped,
                "scales": scales,
                "state": {k: v.clone() for k, v in pipe.state_dict().items()},
            }
        )
    return results


def refusals() -> list[str]:
    """The messages of precision settings that cannot run."""
    messages = []
    for settings in (
        {"precision": "fp8", "optimizer": adamw},
        {"precision": "fp16"},
        {"precision": "fp16", "optimizer": adamw, "schedule": "pipedream"},
    ):
        try:
            make_pipeline(mlp(), loss_fn=nn.functional.cross_entropy, **settings)
        except ValueError as error:
            messages.append(str(error))
    return messages


TWO_RANK_LOOPS: list[dict[str, Any]] = [
    {"balance": [2, 3], "microbatches": 2, "schedule": "1f1b", "precision": "fp16"},
    {"balance": [3, 2], "microbatches": 4, "schedule": "zb-h1", "precision": "fp16"},
    {"balance": [2, 3], "microbatches": 2, "schedule": "gpipe", "precision": "bf16"},
]
THREE_RANK_LOOPS: list[dict[str, Any]] = [
    # the middle stage (Tanh, Dropout) has no parameters
    {"balance": [1, 2, 2], "microbatches": 2, "schedule": "1f1b", "precision": "fp16"},
    {"balance": [2, 3], "replicas": [2, 1], "microbatches": 4, "precision": "fp16"},
]


def two_rank_checks() -> dict[str, Any]:
    """Everything the 2-rank test checks, in one group."""
    return {"loops": pipelined_loop(TWO_RANK_LOOPS), "refusals": refusals()}


def three_rank_checks() -> dict[str, Any]:
    """Everything the 3-rank test checks, in one group."""
    return {"loops": pipelined_loop(THREE_RANK_LOOPS)}
