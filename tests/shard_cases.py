"""Worker functions for the sharded-stage tests (importable by spawned workers)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import graph_cases
import precision_cases
import torch
import training_cases as cases
from settings import make_pipeline
from torch.distributed.tensor import DTensor

from pipetrain.runtime.rank.precision import LossScale


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter or buffer whole: a sharded one gathered (every replica calls it)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def sharded_loop(schedule: str, root: str) -> dict[str, Any]:
    """The reference loop on 2 stages x 2 sharded replicas, saved under ``root`` at its end:
    every call's loss, the whole weights this rank's stage ends with, how much of its
    stage's parameters, gradients and optimizer state this rank holds, and (rank 0) the last
    step's measured actions."""
    pipe = cases.loop_pipeline(
        schedule=schedule,
        microbatches=4,
        balance=[2, 3],
        data_parallel=2,
        shard=True,
        record=True,
    )
    losses = []
    for k, (x, y) in enumerate(cases.calls()):
        update = k % cases.ACCUMULATE == cases.ACCUMULATE - 1
        losses.append(pipe.train_step(x, y, update=update))
    timeline = pipe.timeline()
    held = sum(p.to_local().numel() for p in pipe.parameters() if isinstance(p, DTensor))
    whole = sum(p.numel() for p in pipe.parameters())
    optimizer = pipe.optimizer
    assert optimizer is not None
    state = [
        v.to_local() if isinstance(v, DTensor) else v
        for per_parameter in optimizer.state.values()
        for v in per_parameter.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    saved = pipe.save(Path(root) / schedule)
    return {
        "losses": losses,
        "state": {name: _full(t).clone() for name, t in pipe.state_dict().items()},
        "held": held,
        "whole": whole,
        "optimizer_held": sum(t.numel() for t in state),
        "grad_held": sum(
            p.grad.to_local().numel() for p in pipe.parameters() if isinstance(p.grad, DTensor)
        ),
        "updates": pipe.updates,
        "saved": str(saved),
        # the last step's measured (rank, kind, stage) in order on rank 0
        "measured": None
        if timeline is None
        else [(e.rank, e.kind, e.stage) for e in timeline.events],
    }


def refusals() -> list[str]:
    """What sharding refuses, with the reason: one message per setting."""
    messages = []
    for settings in (
        {"shard": True},
        {"shard": True, "data_parallel": 2, "balance": [2, 3], "schedule": "pipedream"},
        {"shard": True, "data_parallel": 2, "balance": [2, 3], "microbatches": 1},
        {"data_parallel": 3},
    ):
        try:
            cases.loop_pipeline(**{"microbatches": 4, **settings})
            messages.append("accepted")
        except ValueError as error:
            messages.append(str(error))
    return messages


def fp16_loop() -> dict[str, Any]:
    """The mixed-precision tests' fp16 loop (a loss scale that overflows, backs off and
    grows) on 2 stages x 2 sharded replicas."""
    pipe = cases.loop_pipeline(
        loss_scale=precision_cases.LOSS_SCALE,
        precision="fp16",
        balance=[2, 3],
        microbatches=4,
        data_parallel=2,
        shard=True,
    )
    losses, skipped, scales = precision_cases.scaled_steps(pipe)
    state = {name: _full(t).clone() for name, t in pipe.state_dict().items()}
    return {"losses": losses, "skipped": skipped, "scales": scales, "state": state}


def loaded_on_four_stages(path: str) -> dict[str, Any]:
    """A sharded checkpoint loaded into 4 stages with one rank each (another mesh): the
    weights this rank's stage holds, and the update count found."""
    pipe = cases.loop_pipeline(schedule="1f1b", microbatches=4, balance=[1, 1, 1, 2])
    found = pipe.load(path)
    return {"state": {k: v.clone() for k, v in pipe.state_dict().items()}, "updates": found.updates}


def tied_on_sharded_replicas() -> dict[str, Any]:
    """The graph tests' tied model (an embedding that the last layer reuses) on 2 stages x 2
    sharded replicas, as their sequential reference trains it."""
    results = graph_cases.train_sequential([{"balance": [2, 3], "data_parallel": 2, "shard": True}])
    # the first holder's sharded copy, gathered whole (the pickled result needs no mesh)
    return {
        "losses": results[0]["losses"],
        "state": {k: _full(v).clone() for k, v in results[0]["state"].items()},
        "shared": results[0]["shared"],
    }


def llama_on_sharded_replicas(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The stock Llama with tied embeddings, captured, on 2 ranks x 2 sharded replicas
    under each config (a schedule and its options; padded batches, ``causal_lm_loss``):
    every rank's losses and its stages' weights gathered whole."""
    sharded = [{**config, "data_parallel": 2, "shard": True} for config in configs]
    results = graph_cases.train("llama", sharded, padded=True)
    return [
        {
            "losses": result["losses"],
            "state": {k: _full(v).clone() for k, v in result["state"].items()},
            "shared": result["shared"],
        }
        for result in results
    ]


def copied_loop(
    schedule: str, options: dict[str, Any], balance: list[int], shard: bool
) -> dict[str, Any]:
    """The reference loop on 2 copies of a 2-rank ``schedule`` pipeline (data parallelism
    outside the schedule), its stages' replicas sharded or whole: every call's loss and the
    whole weights this rank's stages end with."""
    pipe = cases.loop_pipeline(
        schedule=schedule,
        schedule_options=options,
        microbatches=4,
        balance=balance,
        data_parallel=2,
        shard=shard,
    )
    losses = []
    for k, (x, y) in enumerate(cases.calls()):
        update = k % cases.ACCUMULATE == cases.ACCUMULATE - 1
        losses.append(pipe.train_step(x, y, update=update))
    return {
        "losses": losses,
        "state": {name: _full(t).clone() for name, t in pipe.state_dict().items()},
        "updates": pipe.updates,
    }


def lengths_on_sharded_replicas(schedules: list[str]) -> list[dict[str, Any]]:
    """The GPT on micro-batches of 8 to 1,024 tokens, each padded to its own longest, on 2
    stages x 2 sharded replicas under each schedule: losses and whole weights."""
    import variable_length_cases as lengths

    import pipetrain
    from pipetrain.runtime import MicroBatches

    results = []
    for schedule in schedules:
        pipe = make_pipeline(
            lengths.gpt(),
            microbatches=lengths.MICROBATCHES,
            schedule=schedule,
            loss_fn=pipetrain.causal_lm_loss,
            optimizer=lengths.sgd,
            data_parallel=2,
            shard=True,
        )
        losses = [
            pipe.train_step(MicroBatches([x for x, _ in b]), MicroBatches([y for _, y in b]))
            for b in lengths.step_batches()
        ]
        state = {k: _full(v).clone() for k, v in pipe.state_dict().items()}
        results.append({"schedule": schedule, "losses": losses, "state": state})
    return results


def gpt_on_sharded_replicas(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tensor-parallel tests' GPT and loop (accumulation over two calls, clipping that
    clips, AdamW and a learning-rate schedule) on 2 ranks x 2 sharded replicas under each
    config (a schedule, its options and a balance): every call's loss, the whole weights
    this rank's stages end with, the update count, and the global norm of the first call's
    gradients on the final weights after an accumulating call (``final_norm``)."""
    import tensor_parallel_cases as tp

    from pipetrain.app.models.gpt import gpt_loss

    results = []
    for config in configs:
        pipe = make_pipeline(
            tp.gpt(),
            loss_fn=gpt_loss,
            optimizer=cases.adamw,
            lr_scheduler=cases.scheduler,
            max_grad_norm=cases.MAX_NORM,
            microbatches=4,
            data_parallel=2,
            shard=True,
            **config,
        )
        losses = []
        for k, (x, y) in enumerate(tp.gpt_calls()):
            update = k % cases.ACCUMULATE == cases.ACCUMULATE - 1
            losses.append(pipe.train_step(x, y, update=update))
        state = {name: _full(t).clone() for name, t in pipe.state_dict().items()}
        pipe.train_step(*tp.gpt_calls()[0], update=False)
        results.append(
            {
                "losses": losses,
                "state": state,
                "updates": pipe.updates,
                "final_norm": pipe.clip_grad_norm_(math.inf),
            }
        )
    return results


# a loss scale that neither overflows nor grows in these loops
FP16_SCALE = LossScale(init_scale=2.0**10, growth_interval=1000)


def _accumulated_model(model: str) -> tuple[torch.nn.Module, Any, list[Any]]:
    """The test MLP, or (``"tied"``) the graph tests' model whose last layer reuses the
    embedding's weight: the model, its loss function and every call's batch."""
    if model == "tied":
        ids = [graph_cases.batch(20 + k)["input_ids"] for k in range(len(cases.calls()))]
        return graph_cases.tied_sequential(), graph_cases.lm_loss, [(x, x) for x in ids]
    return cases.mlp(), torch.nn.functional.cross_entropy, cases.calls()


def clipped_after_accumulation(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The reference loop on 2 stages x 2 replicas (``shard`` in each config) of ``model``'s
    (see :func:`_accumulated_model`), whose updates each follow two
    ``train_step(update=False)`` calls: ``pipe.update()`` clipping to the pipeline's
    ``max_grad_norm``, or (``manual``) ``pipe.clip_grad_norm_`` first and no
    ``max_grad_norm``, then, with ``more``, one more accumulating call that adds the first
    call's gradients again after the clip: every call's loss, the norms the clips returned,
    and the whole weights."""
    results = []
    for config in configs:
        manual, more = config.get("manual", False), config.get("more", False)
        model, loss_fn, data = _accumulated_model(config.get("model", "mlp"))
        pipe = make_pipeline(
            model,
            loss_fn=loss_fn,
            optimizer=cases.adamw,
            lr_scheduler=cases.scheduler,
            max_grad_norm=None if manual else cases.MAX_NORM,
            schedule="1f1b",
            microbatches=4,
            balance=[2, 3],
            data_parallel=2,
            shard=config["shard"],
            **({"precision": "fp16", "loss_scale": FP16_SCALE} if config.get("fp16") else {}),
        )
        losses, norms = [], []
        for update in range(cases.UPDATES):
            for x, y in data[update * cases.ACCUMULATE : (update + 1) * cases.ACCUMULATE]:
                losses.append(pipe.train_step(x, y, update=False))
            if manual:
                norms.append(pipe.clip_grad_norm_(cases.MAX_NORM))
            if more:
                pipe.train_step(*data[update * cases.ACCUMULATE], update=False)
            pipe.update()
        state = {name: _full(t).clone() for name, t in pipe.state_dict().items()}
        results.append({"losses": losses, "norms": norms, "state": state, "updates": pipe.updates})
    return results


def accumulation_reference(config: dict[str, Any]) -> dict[str, Any]:
    """The unpipelined loop of a :func:`clipped_after_accumulation` config: accumulate two
    calls, clip, (``more``: add the first call's gradients again, after the clip when
    ``manual``, before it otherwise), step AdamW and the schedule. With ``fp16``, forwards
    under fp16 autocast, micro-batch by micro-batch, and backwards from the scaled loss;
    gradients unscaled before the clip, and those added after it unscaled at the step."""
    manual, more = config.get("manual", False), config.get("more", False)
    model, loss_fn, data = _accumulated_model(config.get("model", "mlp"))
    optimizer = cases.adamw(model.parameters())
    schedule = cases.scheduler(optimizer)
    losses, norms = [], []
    scale = FP16_SCALE.init_scale if config.get("fp16") else 1.0

    def backward(x: torch.Tensor, y: torch.Tensor) -> float:
        if not config.get("fp16"):
            loss = loss_fn(model(x), y)
            loss.backward()
            return float(loss.item())
        total = 0.0
        for xs, ys in zip(x.chunk(4), y.chunk(4)):  # the pipeline's micro-batches
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model(xs), ys)
            loss = loss.float() * (len(xs) / len(x))
            (loss * scale).backward()
            total += loss.item()
        return total

    def scaled(factor: float) -> None:
        for parameter in model.parameters():
            if parameter.grad is not None:
                parameter.grad.mul_(factor)

    for update in range(cases.UPDATES):
        optimizer.zero_grad()
        first = update * cases.ACCUMULATE
        losses += [backward(*data[first + k]) for k in range(cases.ACCUMULATE)]
        if more and not manual:
            backward(*data[first])
        scaled(1 / scale)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cases.MAX_NORM)))
        if more and manual:
            scaled(scale)
            backward(*data[first])
            scaled(1 / scale)
        optimizer.step()
        schedule.step()
    return {"losses": losses, "norms": norms, "state": model.state_dict()}


# the test MLP's Linear(6, 12) colwise and Linear(12, 12) rowwise, both in one stage
ONE_STAGE_PLAN = {"0": "colwise", "3": "rowwise"}


def continued_on_one_tensor_parallel_stage(path: str) -> dict[str, Any]:
    """A checkpoint of the reference loop loaded by one stage on 2 sharded replicas of 2
    tensor-parallel processes each (another mesh), which then trains one more update of the
    loop: its calls' losses, the update count found, and the whole weights at the end."""
    pipe = cases.loop_pipeline(
        schedule="gpipe",
        microbatches=4,
        balance=[5],
        data_parallel=2,
        shard=True,
        tensor_parallel=2,
        tensor_parallel_plan=ONE_STAGE_PLAN,
    )
    found = pipe.load(path)
    more = cases.calls(cases.UPDATES + 1)[cases.UPDATES * cases.ACCUMULATE :]
    losses = [pipe.train_step(x, y, update=k == len(more) - 1) for k, (x, y) in enumerate(more)]
    return {
        "found": found.updates,
        "losses": losses,
        "updates": pipe.updates,
        "held": sum(local_numel(p) for p in pipe.parameters()),
        "whole": sum(p.numel() for p in pipe.parameters()),
        "state": {name: _full(t).clone() for name, t in pipe.state_dict().items()},
    }


def local_numel(tensor: torch.Tensor) -> int:
    """How many of ``tensor``'s elements this process holds."""
    return tensor.to_local().numel() if isinstance(tensor, DTensor) else tensor.numel()
