"""Worker functions for the training-loop tests (importable by spawned workers), and the
unpipelined loop they are compared with."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from pipeline_cases import batch, grads, mlp
from settings import make_pipeline
from torch import nn

import pipetrain
from pipetrain.runtime.rank.update import NonFiniteError

LR, MAX_NORM, UPDATES, ACCUMULATE = 0.05, 0.1, 3, 2


def warmup_cosine(step: int) -> float:
    """Two warm-up updates, then a cosine decay over four."""
    if step < 2:
        return (step + 1) / 2
    return 0.5 * (1 + math.cos(math.pi * min(step - 2, 4) / 4))


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)


def calls(updates: int = UPDATES) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The mini-batches of every call of ``updates`` updates, ``ACCUMULATE`` per update."""
    return [batch(seed=20 + k, size=8) for k in range(updates * ACCUMULATE)]


def reference_loop(updates: int = UPDATES) -> dict[str, Any]:
    """The unpipelined loop: accumulate, clip, step AdamW, step the schedule."""
    model = mlp()
    optimizer = adamw(model.parameters())
    schedule = scheduler(optimizer)
    losses, norms = [], []
    data = calls(updates)
    for update in range(updates):
        optimizer.zero_grad()
        for x, y in data[update * ACCUMULATE : (update + 1) * ACCUMULATE]:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        schedule.step()
    return {"losses": losses, "norms": norms, "state": model.state_dict()}


def loop_pipeline(**settings: Any) -> pipetrain.Pipeline:
    """The test MLP on a pipeline with the loop's AdamW, schedule and clipping."""
    return make_pipeline(
        mlp(),
        loss_fn=nn.functional.cross_entropy,
        optimizer=adamw,
        lr_scheduler=scheduler,
        max_grad_norm=MAX_NORM,
        **settings,
    )


def training_loop(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The loop of :func:`reference_loop` on a pipeline per config."""
    results = []
    for config in configs:
        pipe = loop_pipeline(**config)
        losses = []
        for k, (x, y) in enumerate(calls()):
            losses.append(pipe.train_step(x, y, update=k % ACCUMULATE == ACCUMULATE - 1))
        results.append(
            {
                "losses": losses,
                "state": {k: v.clone() for k, v in pipe.state_dict().items()},
                "updates": pipe.updates,
                "has_optimizer": pipe.optimizer is not None,
                "has_scheduler": pipe.lr_scheduler is not None,
            }
        )
    return results


def update_method() -> dict[str, torch.Tensor]:
    """Accumulate over every call without updating, then pipe.update(); two updates."""
    pipe = make_pipeline(
        mlp(),
        balance=[2, 3],
        replicas=[2, 1],
        microbatches=2,
        schedule="gpipe",
        loss_fn=nn.functional.cross_entropy,
        optimizer=adamw,
        lr_scheduler=scheduler,
        max_grad_norm=MAX_NORM,
    )
    data = calls()
    for update in range(2):
        for x, y in data[update * ACCUMULATE : (update + 1) * ACCUMULATE]:
            pipe.train_step(x, y, update=False)
        pipe.update()
    return {k: v.clone() for k, v in pipe.state_dict().items()}


def manual_clip(configs: list[dict[str, Any]]) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """One step without an optimizer, then clip_grad_norm_: (norm, clipped gradients)."""
    results = []
    for config in configs:
        pipe = make_pipeline(mlp(), loss_fn=nn.functional.cross_entropy, **config)
        pipe.train_step(*batch())
        norm = pipe.clip_grad_norm_(MAX_NORM)
        results.append((norm, grads(pipe)))
    return results


def _state(pipe: pipetrain.Pipeline) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in pipe.state_dict().items()}


def _unchanged(before: dict[str, torch.Tensor], pipe: pipetrain.Pipeline) -> bool:
    return all(torch.equal(value, pipe.state_dict()[name]) for name, value in before.items())


def nonfinite(policy: str) -> dict[str, Any]:
    """A good step, a step with a NaN input, another good step, under ``policy``."""
    pipe = make_pipeline(
        mlp(),
        balance=[2, 3],
        microbatches=2,
        loss_fn=nn.functional.cross_entropy,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        on_nonfinite=policy,
    )
    pipe.train_step(*batch(seed=1))
    before = _state(pipe)
    x, y = batch(seed=2)
    x[3, 1] = float("nan")
    result: dict[str, Any] = {"error": None, "warnings": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            pipe.train_step(x, y)
        except NonFiniteError as error:
            result["error"] = str(error)
    result["warnings"] = [str(w.message) for w in caught if w.category is RuntimeWarning]
    result["unchanged"] = _unchanged(before, pipe)
    result["grads_after"] = len(grads(pipe))
    pipe.train_step(*batch(seed=3))
    result["moved_on"] = not _unchanged(before, pipe)
    result["updates"], result["skipped"] = pipe.updates, pipe.skipped_updates
    return result


def per_sample_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target, reduction="none")


def non_scalar_loss() -> None:
    """A loss without reduction: the step fails before any weight changes."""
    pipe = make_pipeline(
        mlp(),
        balance=[2, 3],
        microbatches=2,
        loss_fn=per_sample_loss,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        timeout_s=30,
    )
    before = _state(pipe)
    try:
        pipe.train_step(*batch())
    except pipetrain.PipelineError:
        if not _unchanged(before, pipe):
            raise AssertionError(f"rank {pipe.rank}: the weights changed") from None
        raise


def refusals() -> list[str]:
    """Messages of settings that cannot run."""
    messages = []
    attempts = [
        lambda: make_pipeline(
            mlp(),
            schedule="pipedream",
            balance=[2, 3],
            microbatches=4,
            loss_fn=nn.functional.cross_entropy,
            optimizer=adamw,
            max_grad_norm=1.0,
        ),
        lambda: make_pipeline(
            mlp(),
            schedule="pipedream",
            balance=[2, 3],
            loss_fn=nn.functional.cross_entropy,
            optimizer=adamw,
            on_nonfinite="skip",
        ),
        lambda: make_pipeline(
            mlp(), balance=[2, 3], loss_fn=nn.functional.cross_entropy, max_grad_norm=1.0
        ),
        lambda: make_pipeline(
            mlp(), balance=[2, 3], loss_fn=nn.functional.cross_entropy, on_nonfinite="ignore"
        ),
        lambda: make_pipeline(
            mlp(),
            schedule="pipedream",
            balance=[2, 3],
            microbatches=2,
            loss_fn=nn.functional.cross_entropy,
            optimizer=adamw,
        ).train_step(*batch(), update=False),
    ]
    for attempt in attempts:
        try:
            attempt()
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
    return messages


def modes(pipe: pipetrain.Pipeline) -> list[bool]:
    return [m.training for module in pipe.stages.values() for m in module.modules()]


def evaluation() -> dict[str, Any]:
    """eval_step on a model with dropout whose layers are in mixed modes: to every rank,
    to each rank, and the modes after."""
    pipe = make_pipeline(
        mlp(dropout=0.5), balance=[3, 2], microbatches=3, loss_fn=nn.functional.cross_entropy
    )
    for module in pipe.stages.values():
        list(module.modules())[-1].eval()  # one layer per stage left in eval mode
    before = modes(pipe)
    x = batch(seed=3)[0]
    result = {"all": pipe.eval_step(x), "to0": pipe.eval_step(x, to=0)}
    result["to1"] = pipe.eval_step(x, to=1)
    result["modes"] = (before, modes(pipe))
    try:
        pipe.eval_step(x, to=2)
    except ValueError as error:
        result["refused"] = str(error)
    return result


def train_outputs(config: dict[str, Any]) -> tuple[float, Any]:
    """One updating step that returns the outputs, on a batch the micro-batches split
    unevenly."""
    pipe = make_pipeline(
        mlp(),
        loss_fn=nn.functional.cross_entropy,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        **config,
    )
    return pipe.train_step(*batch(seed=4, size=11), return_outputs=True)


def two_rank_checks() -> dict[str, Any]:
    """Everything the 2-rank test checks, in one group."""
    return {
        "loop": training_loop(
            [
                {"balance": [2, 3], "microbatches": 2, "schedule": "1f1b"},
                {"balance": [3, 2], "microbatches": 4, "schedule": "zb-h1"},
            ]
        ),
        "clip": manual_clip([{"balance": [2, 3], "microbatches": 2}]),
        "raise": nonfinite("raise"),
        "skip": nonfinite("skip"),
        "warn": nonfinite("warn"),
        "refusals": refusals(),
        "eval": evaluation(),
        "outputs": train_outputs({"balance": [2, 3], "microbatches": 3}),
    }


THREE_RANK_LOOPS: list[dict[str, Any]] = [
    # the middle stage (Tanh, Dropout) has no parameters
    {"balance": [1, 2, 2], "microbatches": 2, "schedule": "1f1b"},
    {"balance": [2, 3], "replicas": [2, 1], "microbatches": 4, "schedule": "1f1b"},
]


def three_rank_checks() -> dict[str, Any]:
    """Everything the 3-rank test checks, in one group."""
    return {
        "loop": training_loop(THREE_RANK_LOOPS),
        "update": update_method(),
        "clip": manual_clip(
            [{"balance": [2, 3], "replicas": [2, 1], "microbatches": 3, "schedule": "gpipe"}]
        ),
        "outputs": train_outputs({"balance": [2, 3], "replicas": [1, 2], "microbatches": 4}),
    }
