"""A schedule family written outside pipetrain, registered when this module is imported:
in the test process and in every worker process that unpickles a function from here."""

from __future__ import annotations

from collections.abc import Sequence

import pipeline_cases as cases
import torch
from settings import make_pipeline
from torch import nn

import pipetrain
from pipetrain.schedules import Action, Generated, Kind, ScheduleSpec, register
from pipetrain.schedules.registry import Options


def generate(
    ranks: int, microbatches: int, replicas: Sequence[int] | None, options: Options
) -> Generated:
    """Every forward, then the backwards in reverse micro-batch order, then the update."""
    orders = []
    for stage in range(ranks):
        order = [Action(Kind.FORWARD, stage, k) for k in range(microbatches)]
        order += [Action(Kind.BACKWARD, stage, k) for k in reversed(range(microbatches))]
        orders.append([*order, Action(Kind.STEP, stage)])
    return Generated(orders, [(stage,) for stage in range(ranks)])


SPEC = register(
    ScheduleSpec(
        name="gpipe-lifo",
        summary="fill and drain, the backwards last micro-batch first",
        generate=generate,
    ),
    replace=True,
)

WRITTEN = """
# stage 1 runs two forwards ahead, then alternates; stage 0 drains in order
rank 0: F0.0 F0.1 F0.2 F0.3 B0.0 B0.1 B0.2 B0.3 STEP0
rank 1: F1.0 F1.1 B1.0 F1.2 B1.1 F1.3 B1.2 B1.3 STEP1
"""


def train(schedule: str | None, microbatches: int) -> tuple[float, dict[str, torch.Tensor]]:
    """One training step of the test model over 2 ranks, with the registered family named
    ``schedule``, or (``None``) with the schedule read from :data:`WRITTEN`."""
    chosen: str | pipetrain.schedules.Schedule = (
        pipetrain.schedules.Schedule.from_text(WRITTEN) if schedule is None else schedule
    )
    pipe = make_pipeline(
        cases.mlp(),
        balance=[2, 3],
        microbatches=microbatches,
        schedule=chosen,
        loss_fn=nn.functional.cross_entropy,
        timeout_s=300,
    )
    loss = pipe.train_step(*cases.batch())
    return loss, cases.grads(pipe)
