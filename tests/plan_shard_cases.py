"""Worker functions for the sharded-plan tests (importable by spawned workers)."""

from __future__ import annotations

from typing import Any

import training_cases as cases
from shard_cases import _full
from torch.distributed.tensor import DTensor

from pipetrain.planning import Plan


def planned_loop(plan: dict[str, Any]) -> dict[str, Any]:
    """The reference loop on the pipeline of ``plan`` (a :meth:`Plan.to_dict`): every
    call's loss, this rank's stage, whether it holds shards, and its weights whole."""
    pipe = cases.loop_pipeline(plan=Plan.from_dict(plan))
    losses = []
    for k, (x, y) in enumerate(cases.calls()):
        losses.append(pipe.train_step(x, y, update=k % cases.ACCUMULATE == cases.ACCUMULATE - 1))
    return {
        "losses": losses,
        "stage": min(pipe.stages),
        "sharded": any(isinstance(p, DTensor) for p in pipe.parameters()),
        "state": {name: _full(t).clone() for name, t in pipe.state_dict().items()},
    }
