"""Worker functions for the checkpoint tests (importable by spawned workers), and the
unpipelined loop they are compared with."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.distributed as dist
from pipeline_cases import batch, mlp
from settings import make_pipeline
from torch import nn
from training_cases import adamw, scheduler

import pipetrain
from pipetrain import checkpoint
from pipetrain.checkpoint import named_optimizer

UPDATES, SAVED_AT = 4, 2
SCALER = {"scale": 1024.0, "growth_tracker": 3}


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One mini-batch per update."""
    return [batch(seed=40 + k, size=8) for k in range(UPDATES)]


def wide() -> nn.Sequential:
    """The test model with a wider hidden layer: another model's checkpoint."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.0), nn.Linear(16, 12), nn.Linear(12, 3)
    )


def reference_loop(model: nn.Module, start: int = 0, **loaded: Any) -> dict[str, Any]:
    """The unpipelined loop from update ``start``: AdamW and a warm-up and cosine schedule;
    with ``loaded``, the optimizer and scheduler come from ``checkpoint.load_full``."""
    optimizer = adamw(model.parameters())
    schedule = scheduler(optimizer)
    found = None
    if loaded:
        found = checkpoint.load_full(loaded["path"], model, optimizer, schedule)
    losses = []
    for x, y in data()[start:]:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict(), "found": found}


def make_pipe(model: nn.Module, **config: Any) -> pipetrain.Pipeline:
    return make_pipeline(
        model,
        loss_fn=nn.functional.cross_entropy,
        optimizer=adamw,
        lr_scheduler=scheduler,
        **config,
    )


def train_steps(pipe: pipetrain.Pipeline, start: int, stop: int) -> list[float]:
    return [pipe.train_step(x, y) for x, y in data()[start:stop]]


def _state(pipe: pipetrain.Pipeline) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in pipe.state_dict().items()}


def _optimizer_state(pipe: pipetrain.Pipeline) -> dict[str, Any]:
    if pipe.optimizer is None:
        return {}
    names = {id(p): n for n, p in pipe.named_parameters()}
    return copy.deepcopy(named_optimizer.entries(pipe.optimizer, names))


def load_and_train(pipe: pipetrain.Pipeline, root: str, start: int) -> dict[str, Any]:
    """Load the newest checkpoint under ``root`` and train from update ``start``."""
    found = checkpoint.load(pipe, root)
    loaded = {"state": _state(pipe), "optimizer": _optimizer_state(pipe), "found": found}
    loaded["scheduler"] = None if pipe.lr_scheduler is None else pipe.lr_scheduler.state_dict()
    loaded["updates"] = pipe.updates
    loaded["precision"] = pipe.precision.state_dict()
    loaded["versions"] = pipe.weight_versions
    loaded["losses"] = train_steps(pipe, start, UPDATES)
    loaded["final"] = _state(pipe)
    return loaded


def same_layout(root: str, group: dist.ProcessGroup, **config: Any) -> dict[str, Any]:
    """Uninterrupted, and saved after ``SAVED_AT`` then resumed in a new pipeline (the model
    built afresh, which reseeds the random state)."""
    whole = make_pipe(mlp(dropout=0.3), group=group, **config)
    uninterrupted = {"losses": train_steps(whole, 0, UPDATES), "final": _state(whole)}
    first = make_pipe(mlp(dropout=0.3), group=group, **config)
    train_steps(first, 0, SAVED_AT)
    checkpoint.save(first, root, extra={"next": SAVED_AT}, keep=1)
    second = make_pipe(mlp(dropout=0.3), group=group, **config)
    return {"uninterrupted": uninterrupted, "resumed": load_and_train(second, root, SAVED_AT)}


def layouts(root: str) -> dict[str, Any]:
    """On three ranks: checkpoints saved on two of them and loaded on other layouts."""
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])
    result: dict[str, Any] = {}
    saved = os.path.join(root, "two")
    if rank < 2:
        pipe = make_pipe(mlp(), balance=[2, 3], microbatches=2, group=pair)
        result["saving"] = train_steps(pipe, 0, SAVED_AT)
        pipe.precision.load_state_dict(SCALER)  # a loss scaler's state travels too
        for step in (1, SAVED_AT):  # an older checkpoint to be pruned
            checkpoint.save(pipe, saved, step=step, extra={"next": SAVED_AT}, keep=1)
        result["same"] = same_layout(
            os.path.join(root, "dropout"), pair, balance=[3, 2], microbatches=3
        )
        result["pipedream"] = same_layout(
            os.path.join(root, "pipedream"),
            pair,
            balance=[2, 3],
            microbatches=2,
            schedule="pipedream",
        )
    dist.barrier()
    result["three"] = load_and_train(
        make_pipe(mlp(seed=5), balance=[1, 2, 2], microbatches=3, schedule="gpipe"), saved, SAVED_AT
    )
    result["replicated"] = load_and_train(
        make_pipe(mlp(seed=5), balance=[2, 3], replicas=[2, 1], microbatches=4), saved, SAVED_AT
    )
    pipedream = make_pipe(mlp(seed=5), balance=[1, 2, 2], microbatches=3, schedule="pipedream")
    result["pipedream_three"] = load_and_train(pipedream, os.path.join(root, "pipedream"), SAVED_AT)
    try:
        checkpoint.load(make_pipe(wide(), balance=[1, 2, 2]), saved)
        result["refused"] = "no error"
    except checkpoint.CheckpointMismatch as error:
        result["refused"] = str(error)
    return result


def merged(results: list[dict[str, Any]], key: str) -> dict[str, torch.Tensor]:
    """The entries ``key`` of every rank's result, in one dictionary."""
    state: dict[str, torch.Tensor] = {}
    for result in results:
        state.update(result[key])
    return state


def assert_close_state(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """The same names, and values equal up to float rounding."""
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


def assert_equal_state(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """The same names, and values equal bit for bit."""
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def assert_loaded_as_exported(runs: list[dict[str, Any]], exported: dict[str, Any]) -> None:
    """The ranks of ``runs`` together hold the exported weights, and each its parameters'
    exported optimizer state and the exported scheduler state."""
    assert_equal_state(merged(runs, "state"), exported["model"])
    for run in runs:
        for key, value in run["optimizer"].items():
            kind, name, *rest = key.split("/")
            if kind == "optimizer_group":
                assert value == exported["optimizer"]["groups"][name], key
            else:
                assert torch.equal(value, exported["optimizer"]["state"][name][rest[0]]), key
        if run["scheduler"] is not None:
            assert run["scheduler"] == exported["lr_scheduler"]
