"""A small residual network with batch normalization, and the worker functions of the
batch-normalization tests (importable by spawned workers)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from settings import make_pipeline
from torch import nn

from pipetrain.runtime.rank.batchnorm import convert_deferred_batch_norm

CHANNELS, CLASSES, BATCH, STEPS, LR = 4, 3, 12, 2, 0.05
MODES = ("never", "except_last", "always")


class Block(nn.Module):
    """Conv, batch norm, ReLU, conv, batch norm, plus the input, then ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1, bias=False)
        self.norm1 = nn.BatchNorm2d(CHANNELS)
        self.conv2 = nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1, bias=False)
        self.norm2 = nn.BatchNorm2d(CHANNELS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(x + self.norm2(self.conv2(inner)))


def resnet(seed: int = 0) -> nn.Sequential:
    """Stem, four blocks and a head: six layers."""
    torch.manual_seed(seed)
    stem = nn.Sequential(
        nn.Conv2d(3, CHANNELS, 3, padding=1, bias=False), nn.BatchNorm2d(CHANNELS), nn.ReLU()
    )
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(CHANNELS, CLASSES))
    return nn.Sequential(stem, Block(), Block(), Block(), Block(), head)


def images(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, 3, 5, 5, generator=generator) * 2 + 0.5
    return x, torch.randint(0, CLASSES, (BATCH,), generator=generator)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def reference(microbatches: int, deferred: bool = False) -> dict[str, Any]:
    """The unpipelined model run micro-batch by micro-batch as the pipeline does (each
    loss weighted by its share of the samples). With ``deferred``, the running statistics
    are instead those of a batch norm fed, once per step, every micro-batch's input to that
    layer at once: the whole batch's statistics."""
    model = resnet()
    optimizer = adamw(model.parameters())
    norms = {n: m for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)}
    whole = {n: copy.deepcopy(m) for n, m in norms.items()}
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in norms}
    for name, norm in norms.items():
        norm.register_forward_pre_hook(lambda _, args, name=name: seen[name].append(args[0]))
    losses = []
    for step in range(STEPS):
        x, y = images(step)
        loss = 0.0
        for xs, ys in zip(x.tensor_split(microbatches), y.tensor_split(microbatches)):
            part = nn.functional.cross_entropy(model(xs), ys) * (len(ys) / BATCH)
            part.backward()
            loss += part.item()
        with torch.no_grad():
            for name, inputs in seen.items():
                whole[name](torch.cat(inputs))
                inputs.clear()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss)
    state = model.state_dict()
    if deferred:
        for name, norm in whole.items():
            for key in ("running_mean", "running_var", "num_batches_tracked"):
                state[f"{name}.{key}"] = getattr(norm, key)
    return {"losses": losses, "state": state}


def train(config: dict[str, Any]) -> dict[str, Any]:
    pipe = make_pipeline(resnet(), loss_fn=nn.functional.cross_entropy, optimizer=adamw, **config)
    losses = [pipe.train_step(*images(step)) for step in range(STEPS)]
    return {"losses": losses, "state": {k: v.clone() for k, v in pipe.state_dict().items()}}


def layouts(ranks: int) -> list[dict[str, Any]]:
    """gpipe, 1f1b, zb-h1 and interleaved on ``ranks`` ranks."""
    straight = {2: [3, 3], 3: [2, 2, 2]}[ranks]
    chunked = {2: [1, 2, 2, 1], 3: [1] * 6}[ranks]
    microbatches = {2: 4, 3: 3}[ranks]
    return [
        {"balance": straight, "microbatches": microbatches, "schedule": "gpipe"},
        {"balance": straight, "microbatches": microbatches, "schedule": "1f1b"},
        {"balance": straight, "microbatches": microbatches, "schedule": "zb-h1"},
        {
            "balance": chunked,
            "microbatches": microbatches,
            "schedule": "interleaved",
            "schedule_options": {"virtual": 2},
        },
    ]


def configs(ranks: int) -> list[dict[str, Any]]:
    """Every layout under every recompute mode, then two with deferred batch norm."""
    every = [{**layout, "recompute": mode} for layout in layouts(ranks) for mode in MODES]
    deferred = [
        {**layouts(ranks)[1], "recompute": "always", "deferred_batch_norm": True},
        {**layouts(ranks)[3], "recompute": "except_last", "deferred_batch_norm": True},
    ]
    return every + deferred


def runs(ranks: int) -> list[dict[str, Any]]:
    return [train(config) for config in configs(ranks)]


def deferred_eval(x: torch.Tensor) -> torch.Tensor:
    """A converted model in eval mode (the running statistics)."""
    return convert_deferred_batch_norm(resnet(), 3).eval()(x)
