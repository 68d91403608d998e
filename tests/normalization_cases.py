"""A small causal language model, padded batches, and the worker functions of the
token-level loss tests (importable by spawned workers)."""

from __future__ import annotations

from typing import Any

import torch
from settings import make_pipeline
from torch import nn

import pipetrain

VOCAB, WIDTH, LENGTH, BATCH, STEPS, LR = 11, 8, 7, 12, 2, 0.05


def language_model(seed: int = 0) -> nn.Sequential:
    """Embedding, then position-wise layers to the logits: six layers."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Embedding(VOCAB, WIDTH),
        nn.Linear(WIDTH, WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, VOCAB),
    )


def padded_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids padded with 0 after each sequence's length, and labels with -100 there.
    The lengths grow along the batch, so micro-batches count very different numbers of
    tokens (the first sequences have one token, which predicts nothing)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (BATCH, LENGTH), generator=generator)
    lengths = torch.linspace(1, LENGTH, BATCH).round().long()
    padding = torch.arange(LENGTH)[None, :] >= lengths[:, None]
    labels = ids.masked_fill(padding, -100)
    return ids.masked_fill(padding, 0), labels


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def reference(accumulate: int = 1, fp16_microbatches: int = 0) -> dict[str, Any]:
    """The unpipelined model: each call's loss is its whole batch's token mean, and the
    calls' gradients add up over ``accumulate`` calls per AdamW update. With
    ``fp16_microbatches``, float16 autocast forwards of that many micro-batches, each
    backward from its share of the token mean under GradScaler."""
    model = language_model()
    optimizer = adamw(model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=fp16_microbatches > 0)
    losses = []
    for step in range(STEPS * accumulate):
        if step % accumulate == 0:
            optimizer.zero_grad()
        ids, labels = padded_batch(seed=step)
        parts = max(fp16_microbatches, 1)
        count = int((labels[:, 1:] != -100).sum())
        loss = 0.0
        for xs, ys in zip(ids.tensor_split(parts), labels.tensor_split(parts)):
            with torch.autocast("cpu", dtype=torch.float16, enabled=fp16_microbatches > 0):
                total, _ = pipetrain.causal_lm_loss(model(xs), ys)
            scaler.scale(total / count).backward()
            loss += total.item() / count
        losses.append(loss)
        if step % accumulate == accumulate - 1:
            scaler.step(optimizer)
            scaler.update()
    return {"losses": losses, "state": model.state_dict(), "grads": grads(model)}


def grads(model: nn.Module | pipetrain.Pipeline) -> dict[str, torch.Tensor]:
    """The gradients of the last update (kept after it), by parameter name."""
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def train(config: dict[str, Any]) -> dict[str, Any]:
    """The loop of :func:`reference` on a pipeline (``accumulate`` in ``config``)."""
    settings = dict(config)
    accumulate = settings.pop("accumulate", 1)
    pipe = make_pipeline(
        language_model(), loss_fn=pipetrain.causal_lm_loss, optimizer=adamw, **settings
    )
    losses = []
    for step in range(STEPS * accumulate):
        update = step % accumulate == accumulate - 1
        losses.append(pipe.train_step(*padded_batch(seed=step), update=update))
    state = {k: v.clone() for k, v in pipe.state_dict().items()}
    return {"losses": losses, "state": state, "grads": grads(pipe)}


def refusal() -> str:
    """The message of a pair-returning loss on an asynchronous schedule."""
    pipe = make_pipeline(
        language_model(),
        balance=[3, 3],
        microbatches=2,
        schedule="2bw",
        loss_fn=pipetrain.causal_lm_loss,
        optimizer=adamw,
        timeout_s=30,
    )
    try:
        pipe.train_step(*padded_batch(seed=0))
    except pipetrain.PipelineError as error:
        return str(error)
    return "no error"


TWO_RANKS: list[dict[str, Any]] = [
    {"balance": [3, 3], "microbatches": 4, "schedule": "gpipe"},
    {"balance": [2, 4], "microbatches": 3, "schedule": "1f1b", "recompute": "except_last"},
    {"balance": [3, 3], "microbatches": 4, "schedule": "zb-h1"},
    {
        "balance": [1, 2, 1, 2],
        "microbatches": 4,
        "schedule": "interleaved",
        "schedule_options": {"virtual": 2},
    },
    {"balance": [3, 3], "microbatches": 3, "schedule": "1f1b", "accumulate": 2},
    {"balance": [3, 3], "microbatches": 4, "schedule": "1f1b", "precision": "fp16"},
]

THREE_RANKS: list[dict[str, Any]] = [
    {"balance": [2, 2, 2], "microbatches": 3, "schedule": "gpipe"},
    {"balance": [2, 2, 2], "microbatches": 4, "schedule": "1f1b"},
    {"balance": [2, 2, 2], "microbatches": 3, "schedule": "zb-h1"},
    {
        "balance": [1] * 6,
        "microbatches": 3,
        "schedule": "interleaved",
        "schedule_options": {"virtual": 2},
    },
    # the last stage's replicas count their own tokens; the first stage's accumulate
    {"balance": [3, 3], "replicas": [1, 2], "microbatches": 4, "schedule": "1f1b"},
    {"balance": [3, 3], "replicas": [2, 1], "microbatches": 4, "accumulate": 2},
]


def two_ranks() -> dict[str, Any]:
    return {"runs": [train(config) for config in TWO_RANKS], "refusal": refusal()}


def three_ranks() -> dict[str, Any]:
    return {"runs": [train(config) for config in THREE_RANKS]}
