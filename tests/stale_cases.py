"""Worker functions for the one-step-stale roundpipe tests (importable by spawned
workers), and the one-process replay of the stale rule they are compared with: the
built-in GPT of :mod:`roundpipe_cases` (AdamW, warm-up and cosine schedule, two calls
per update, global clipping), each update's step applied one update late."""

from __future__ import annotations

import warnings
from typing import Any, cast

import precision_cases
import roundpipe_cases as cases
import torch
from pipeline_cases import mlp
from settings import make_pipeline
from torch import nn
from training_cases import adamw, loop_pipeline, scheduler

import pipetrain
from pipetrain.app.models.gpt import gpt_loss

UPDATES = 4


def gpt(tied: bool) -> nn.Sequential:
    """:func:`roundpipe_cases.gpt`; with ``tied``, the head's weight is the token
    embedding's (one parameter of the first and the last stage)."""
    model = cases.gpt()
    if tied:
        head, embedding = cast(Any, model[-1]), cast(Any, model[0])
        head.out.weight = embedding.token.weight
    return model


def pipeline(clip: bool, tied: bool, **settings: Any) -> pipetrain.Pipeline:
    """The GPT on a pipeline with the replay's optimizer, schedule and clipping."""
    return make_pipeline(
        gpt(tied),
        loss_fn=gpt_loss,
        optimizer=cases.adamw,
        lr_scheduler=scheduler,
        max_grad_norm=cases.MAX_NORM if clip else None,
        timeout_s=60,
        **settings,
    )


def _apply(
    optimizer: torch.optim.Optimizer,
    parameters: list[nn.Parameter],
    step: tuple[list[torch.Tensor | None], float],
) -> None:
    """A waiting step: its gradients on ``parameters``, ``optimizer`` stepped at its
    learning rate (the current one kept)."""
    grads, lr = step
    current = optimizer.param_groups[0]["lr"]
    for parameter, grad in zip(parameters, grads):
        parameter.grad = grad
    optimizer.param_groups[0]["lr"] = lr
    optimizer.step()
    optimizer.param_groups[0]["lr"] = current


def stale_replay(
    clip: bool, tied: bool = False, updates: int = UPDATES, flush_after: int | None = None
) -> dict[str, Any]:
    """The unpipelined loop under the stale rule: update k's gradients are computed on the
    weights that lack update k − 1's step; that step (with its own learning rate) is
    applied once they are, and update k's waits for the next update. After update
    ``flush_after`` (counted from 1), and at the end, the waiting step is applied at once.
    Every call's loss and the weights at the end."""
    model = gpt(tied)
    parameters = list(model.parameters())
    optimizer = cases.adamw(parameters)
    schedule = scheduler(optimizer)
    data = cases.calls(updates)
    losses: list[float] = []
    norms: list[float] = []
    waiting: tuple[list[torch.Tensor | None], float] | None = None

    for update in range(updates):
        for parameter in parameters:
            parameter.grad = None
        for x, y in data[update * cases.ACCUMULATE : (update + 1) * cases.ACCUMULATE]:
            loss = torch.zeros(())
            for xs, ys in zip(
                x.tensor_split(cases.MICROBATCHES), y.tensor_split(cases.MICROBATCHES)
            ):
                part = gpt_loss(model(xs), ys) * (len(xs) / len(x))
                part.backward()
                loss += part.detach()
            losses.append(loss.item())
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(parameters, cases.MAX_NORM)))
        grads = [None if p.grad is None else p.grad.clone() for p in parameters]
        if waiting is not None:
            _apply(optimizer, parameters, waiting)
        waiting = (grads, optimizer.param_groups[0]["lr"])
        with warnings.catch_warnings():  # the first update's step waits: none was made yet
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            schedule.step()
        if update + 1 == updates:  # evaluated with the last update's step waiting
            model.eval()
            with torch.no_grad():
                evaluated = model(data[0][0])
        if update + 1 == flush_after or update + 1 == updates:
            _apply(optimizer, parameters, waiting)
            waiting = None
    return {"losses": losses, "norms": norms, "state": model.state_dict(), "evaluated": evaluated}


def train(pipe: pipetrain.Pipeline, start: int, stop: int) -> list[float]:
    """Calls ``start`` to ``stop`` of the loop's, updating every ``ACCUMULATE``th."""
    data = cases.calls(UPDATES)
    return [
        pipe.train_step(x, y, update=k % cases.ACCUMULATE == cases.ACCUMULATE - 1)
        for k, (x, y) in enumerate(data[start:stop], start)
    ]


def stale_loops(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per config (``clip``, ``tied`` and the pipeline's settings), the loop on a stale roundpipe
    pipeline, its waiting step applied by ``update()`` at the end: every call's loss,
    whether a step waited before that, the evaluation of the first batch then (on the
    weights without it), and the weights this rank holds."""
    results = []
    for config in configs:
        settings = dict(config)
        clip, tied = settings.pop("clip"), settings.pop("tied", False)
        options = {**settings.pop("schedule_options"), "stale": True}
        pipe = pipeline(clip, tied, schedule="roundpipe", schedule_options=options, **settings)
        losses = train(pipe, 0, UPDATES * cases.ACCUMULATE)
        waited = pipe._rank.cycle._host.pending
        evaluated = pipe.eval_step(cases.calls(UPDATES)[0][0])
        pipe.update()
        state = {k: v.clone() for k, v in pipe.state_dict().items()}
        results.append(
            {
                "losses": losses,
                "waited": waited,
                "evaluated": evaluated,
                "state": state,
                "updates": pipe.updates,
            }
        )
    return results


SAVED_AFTER = 2  # updates


def stale_saved_and_resumed(root: str) -> dict[str, Any]:
    """A stale run of two ranks: saving with a step waiting (refused, the message kept),
    then after ``update()`` applied it; a new stale pipeline loads it and trains to the
    end. Every call's loss and the weights this rank holds at the end."""
    options = {"model_stages": 4, "stale": True}
    settings = {"schedule": "roundpipe", "microbatches": 4, "schedule_options": options}
    first = pipeline(True, False, **settings)
    calls = SAVED_AFTER * cases.ACCUMULATE
    losses = train(first, 0, calls)
    try:
        first.save(root)
        refusal = ""
    except RuntimeError as error:
        refusal = str(error)
    first.update()
    first.save(root)
    second = pipeline(True, False, **settings)
    found = second.load(root)
    losses += train(second, calls, UPDATES * cases.ACCUMULATE)
    second.update()
    state = {k: v.clone() for k, v in second.state_dict().items()}
    return {"losses": losses, "state": state, "refusal": refusal, "found": found.updates}


def fp16_stale_replay(microbatches: int) -> dict[str, Any]:
    """The mixed-precision tests' fp16 loop (:func:`precision_cases.reference_loop`: updates
    overflow, back off and grow) under the stale rule: an update's gradients unscaled,
    checked and clipped at its end; the step waiting from the update before applied once
    they are computed, overflowed or not; an overflowed update leaves none waiting (and
    steps no learning rate). Every update's loss, skips and scale, and the weights at the
    end, the last waiting step applied."""
    model = mlp()
    parameters = list(model.parameters())
    optimizer = adamw(parameters)
    schedule = scheduler(optimizer)
    scaler = precision_cases.grad_scaler()
    losses, skipped, scales = [], [], []
    waiting: tuple[list[torch.Tensor | None], float] | None = None
    for x, y in precision_cases.data():
        optimizer.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(xs), ys)
            loss = loss.float() * (len(xs) / len(x))
            scaler.scale(loss).backward()
            total += loss.item()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(parameters, precision_cases.MAX_NORM)
        before = scaler.get_scale()
        scaler.update()
        overflowed = scaler.get_scale() < before
        grads = [None if p.grad is None else p.grad.clone() for p in parameters]
        if waiting is not None:
            _apply(optimizer, parameters, waiting)
        waiting = None if overflowed else (grads, optimizer.param_groups[0]["lr"])
        if not overflowed:
            with warnings.catch_warnings():  # the first step waits: none was made yet
                warnings.filterwarnings("ignore", "Detected call of `lr_scheduler", UserWarning)
                schedule.step()
        losses.append(total)
        skipped.append(overflowed)
        scales.append(scaler.get_scale())
    if waiting is not None:
        _apply(optimizer, parameters, waiting)
    return {"losses": losses, "skipped": skipped, "scales": scales, "state": model.state_dict()}


def fp16_stale_loop(config: dict[str, Any]) -> dict[str, Any]:
    """:func:`fp16_stale_replay`'s loop on a stale roundpipe pipeline of ``config``'s
    settings, its waiting step applied by ``update()`` at the end."""
    settings = dict(config)
    options = {**settings.pop("schedule_options"), "stale": True}
    pipe = loop_pipeline(
        loss_scale=precision_cases.LOSS_SCALE,
        precision="fp16",
        schedule_options=options,
        **settings,
    )
    losses, skipped, scales = precision_cases.scaled_steps(pipe)
    pipe.update()
    state = {k: v.clone() for k, v in pipe.state_dict().items()}
    return {"losses": losses, "skipped": skipped, "scales": scales, "state": state}
