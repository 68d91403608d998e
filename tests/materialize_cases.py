"""Worker function for the meta-device pipeline test (importable by spawned workers)."""

from __future__ import annotations

from typing import Any

import torch
import training_cases as cases
from pipeline_cases import mlp
from settings import make_pipeline
from torch import nn


def meta_loop(weights: str) -> dict[str, Any]:
    """The training loop of :func:`training_cases.reference_loop` on a model built on the
    meta device and loaded from ``weights``; which of the model's parameters this rank
    made real."""
    with torch.device("meta"):
        model = mlp()
    pipe = make_pipeline(
        model,
        balance=[2, 3],
        microbatches=2,
        loss_fn=nn.functional.cross_entropy,
        optimizer=cases.adamw,
        lr_scheduler=cases.scheduler,
        max_grad_norm=cases.MAX_NORM,
        weights=weights,
    )
    losses = []
    for k, (x, y) in enumerate(cases.calls()):
        losses.append(pipe.train_step(x, y, update=k % cases.ACCUMULATE == cases.ACCUMULATE - 1))
    return {
        "losses": losses,
        "state": {k: v.clone() for k, v in pipe.state_dict().items()},
        "real": sorted(n for n, p in model.named_parameters() if not p.is_meta),
    }


def llama_config() -> Any:
    """A tiny Llama's configuration."""
    from transformers import LlamaConfig

    return LlamaConfig(
        num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=32, max_position_embeddings=32,
    )  # fmt: skip


def meta_llama_recipe() -> dict[str, Any]:
    """A Llama built on the meta device and pipelined with the README's initializer
    (``init_fn=lambda stage: stage.apply(model._init_weights)``), trained 2 steps: this
    rank's losses and buffers."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config())
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    pipe = make_pipeline(
        model,
        example_inputs={k: v[:2] for k, v in batch.items()},
        microbatches=2,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        init_fn=lambda stage: stage.apply(model._init_weights),
    )
    losses = [pipe.train_step(batch) for _ in range(2)]
    buffers = {k: v.clone() for s in pipe.stages.values() for k, v in s.named_buffers()}
    return {"losses": losses, "buffers": buffers}
