"""Worker functions for the four-layer checkpoint tests (importable by spawned workers): a
checkpoint saved on balance ``[2, 2]`` loaded on ``[1, 3]``, on three stages and into the
unpipelined model; and a one-process replay of pipedream's weight versions across layouts."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from checkpoint_cases import SAVED_AT, load_and_train, make_pipe, train_steps
from pipeline_cases import CLASSES, FEATURES, batch
from settings import make_pipeline
from torch import nn

import pipetrain
from pipetrain import checkpoint
from pipetrain.model.layers import stage_bounds

SAVED, THREE = [2, 2], [1, 1, 2]
WINDOW, LR = 4, 0.2  # pipedream: mini-batches per call, and plain SGD's learning rate


def four(seed: int = 0) -> nn.Sequential:
    """Four layers: balance [2, 2] on two stages, [1, 3] or [1, 1, 2] on others."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(FEATURES, 12), nn.Tanh(), nn.Linear(12, 12), nn.Linear(12, CLASSES)
    )


def window(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pipedream's call ``index``: ``WINDOW`` mini-batches of two samples."""
    return batch(seed=10 + index, size=WINDOW * 2)


def _pipedream(balance: list[int], group: dist.ProcessGroup | None) -> pipetrain.Pipeline:
    return make_pipeline(
        four(seed=5 if balance == THREE else 0),
        balance=balance,
        microbatches=WINDOW,
        schedule="pipedream",
        loss_fn=nn.functional.cross_entropy,
        optimizer=lambda params: torch.optim.SGD(params, lr=LR),
        group=group,
    )


def square(root: str) -> dict[str, Any]:
    """On three ranks: checkpoints saved on ranks 0 and 1 with balance [2, 2] (AdamW with a
    scheduler; pipedream with SGD), loaded on [1, 3] (two ranks) and [1, 1, 2] (three)."""
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])
    saved, versions = os.path.join(root, "square"), os.path.join(root, "square-pipedream")
    result: dict[str, Any] = {}
    if rank < 2:
        pipe = make_pipe(four(), balance=SAVED, microbatches=2, group=pair)
        train_steps(pipe, 0, SAVED_AT)
        checkpoint.save(pipe, saved)
        pipedream = _pipedream(SAVED, pair)
        pipedream.train_step(*window(0))
        checkpoint.save(pipedream, versions)
    dist.barrier()
    if rank < 2:
        result["one_three"] = load_and_train(
            make_pipe(four(seed=5), balance=[1, 3], microbatches=4, group=pair), saved, SAVED_AT
        )
    result["three"] = load_and_train(
        make_pipe(four(seed=5), balance=THREE, microbatches=2, schedule="gpipe"), saved, SAVED_AT
    )
    pipedream = _pipedream(THREE, None)
    found = checkpoint.load(pipedream, versions)
    result["pipedream"] = {
        "found": found.updates,
        "updates": pipedream.updates,
        "versions": pipedream.weight_versions,
        "state": {k: v.clone() for k, v in pipedream.state_dict().items()},
    }
    pipedream.train_step(*window(1))
    result["pipedream"]["after"] = pipedream.updates
    result["pipedream"]["final"] = {k: v.clone() for k, v in pipedream.state_dict().items()}
    return result


def pipedream_replay(balances: list[list[int]]) -> dict[str, torch.Tensor]:
    """Pipedream in one process, call ``w`` on ``balances[w]``: at the call's mini-batch
    ``k``, stage ``s`` of ``p`` computes on the weights after ``k - (p - s) + 1`` of the
    call's updates (the newest it has), and every mini-batch applies one SGD update."""
    model = four()
    versions = [{name: p.detach().clone() for name, p in model.named_parameters()}]
    for index, balance in enumerate(balances):
        owner = {
            f"{layer}.{name}": stage
            for stage, (start, stop) in enumerate(stage_bounds(balance))
            for layer in range(start, stop)
            for name, _ in model[layer].named_parameters()
        }
        base, stages = len(versions) - 1, len(balance)
        x, y = window(index)
        for k, (inputs, targets) in enumerate(
            zip(torch.tensor_split(x, WINDOW), torch.tensor_split(y, WINDOW))
        ):
            weights = {
                name: versions[base + max(0, k - (stages - stage) + 1)][name]
                .clone()
                .requires_grad_(True)
                for name, stage in owner.items()
            }
            loss = nn.functional.cross_entropy(
                torch.func.functional_call(model, weights, (inputs,)), targets
            )
            grads = torch.autograd.grad(loss, list(weights.values()))
            versions.append(
                {name: versions[-1][name] - LR * grad for name, grad in zip(weights, grads)}
            )
    return versions[-1]
