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
