"""Worker functions for the agreement tests (importable by spawned workers)."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from checkpoint_cases import wide
from pipeline_cases import mlp
from settings import make_pipeline
from torch import nn


def _message(build: Callable[[], object]) -> str:
    try:
        build()
    except ValueError as error:
        return str(error)
    return "no error"


def disagreements() -> dict[str, str]:
    """Pipelines whose settings differ between the two ranks; the error each rank raised."""
    rank = dist.get_rank()
    loss = nn.functional.cross_entropy
    return {
        "balance": _message(
            lambda: make_pipeline(mlp(), balance=[[2, 3], [3, 2]][rank], loss_fn=loss)
        ),
        "microbatches": _message(lambda: make_pipeline(mlp(), microbatches=2 + rank, loss_fn=loss)),
        "model": _message(lambda: make_pipeline([mlp(), wide()][rank], loss_fn=loss)),
        "mesh": _message(
            lambda: make_pipeline(
                mlp(), data_parallel=[2, 1][rank], shard=[True, False][rank], loss_fn=loss
            )
        ),
        "agreed": _message(lambda: make_pipeline(mlp(), balance=[2, 3], loss_fn=loss)),
    }
