"""A training run of a built-in model, as ``pipetrain train`` does it.

:func:`run_training` checks the configuration, starts one local worker per stage with
:func:`pipetrain.launch` (or joins the process group that ``torchrun`` started), trains with
Adam, records a timeline of the last step, and compares it with the simulator's prediction
for the same schedule on the stage costs measured in that timeline.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from functools import partial
from typing import Any, TextIO

import torch
import torch.distributed as dist

from pipetrain.app.data import BatchStream
from pipetrain.app.models import build_model, loss_function
from pipetrain.app.plan_job import plan_together
from pipetrain.app.train_config import TrainConfig
from pipetrain.app.train_report import TrainReport
from pipetrain.runtime import Pipeline, launch


class Progress:
    """Prints ``step i/N, loss, samples/s`` on a stream: rewritten in place on a terminal,
    otherwise one line about every tenth of the run."""

    def __init__(self, steps: int, batch_size: int, stream: TextIO = sys.stderr) -> None:
        """Report on ``stream`` for a run of ``steps`` steps of ``batch_size`` samples."""
        self.steps, self.batch_size, self.stream = steps, batch_size, stream
        self.interactive = stream.isatty()
        self.every = 1 if self.interactive else max(1, steps // 10)
        self._last_step, self._last_time = 0, time.perf_counter()

    def update(self, step: int, loss: float) -> None:
        """Report that ``step`` (counted from 1) finished with ``loss``."""
        if step % self.every and step != self.steps:
            return
        now = time.perf_counter()
        rate = (step - self._last_step) * self.batch_size / max(now - self._last_time, 1e-9)
        self._last_step, self._last_time = step, now
        line = f"step {step}/{self.steps}  loss {loss:.4f}  {rate:,.0f} samples/s"
        self.stream.write(f"\r{line}\033[K" if self.interactive else line + "\n")
        if self.interactive and step == self.steps:
            self.stream.write("\n")
        self.stream.flush()


def train_worker(config: TrainConfig) -> dict[str, Any] | None:
    """Train on this rank of the process group; rank 0 returns the configuration it ran
    (with the plan's settings, for ``plan_auto``), losses, step times and the last step's
    timeline (as a dict), other ranks ``None``."""
    if config.plan_auto:
        if dist.get_rank() == 0:
            print(
                f"profiling {config.model} on {config.stages} workers at once, then planning ...",
                file=sys.stderr,
                flush=True,
            )
        # profile with the threads this worker trains with (torchrun's setting, under torchrun)
        chosen = plan_together(config.model, config.samples, config.seed, torch.get_num_threads())
        if dist.get_rank() == 0:
            print(chosen.describe() + "\n", file=sys.stderr, flush=True)
        config = replace(config, plan_auto=False, plan=chosen).resolved(dist.get_world_size())
    model = build_model(config.model, seed=config.seed)
    pipe = Pipeline(
        model,
        loss_fn=loss_function(config.model),
        optimizer=partial(torch.optim.Adam, lr=config.learning_rate),
        config=config.pipeline_config(),
        max_grad_norm=config.max_grad_norm,
    )
    # only the input stage's ranks load data; the targets travel to the last stage
    batches = (
        BatchStream(config.model, config.samples, seed=config.seed) if 0 in pipe.stages else None
    )
    progress = Progress(config.steps, config.samples) if pipe.rank == 0 else None
    losses: list[float] = []
    step_times: list[float] = []
    for step in range(config.steps):
        inputs, targets = next(batches) if batches is not None else (None, None)
        # recording costs a barrier per step, so only the last step is recorded
        pipe.recorder.enabled = step == config.steps - 1
        start = time.perf_counter()
        update = (step + 1) % config.accumulate == 0 or step == config.steps - 1
        losses.append(pipe.train_step(inputs, targets, update=update))
        step_times.append(time.perf_counter() - start)
        if progress is not None:
            progress.update(step + 1, losses[-1])
    timeline = pipe.timeline()
    if timeline is None:
        return None
    return {
        "config": config,
        "losses": losses,
        "step_times_s": step_times,
        "timeline": timeline.to_dict(),
    }


def run_training(config: TrainConfig) -> TrainReport | None:
    """Train as ``config`` says and report; ``None`` on torchrun ranks other than 0.

    Under ``torchrun`` (``WORLD_SIZE`` set) it runs in this process on the existing process
    group (a gloo group is started if none is); otherwise it launches one local worker per
    stage with ``config.threads`` torch threads each.
    """
    if "WORLD_SIZE" in os.environ:
        started_group = not dist.is_initialized()
        if started_group:
            dist.init_process_group("gloo")
        try:
            config = config.resolved(world_size=dist.get_world_size())
            result = train_worker(config)
        finally:
            if started_group:
                dist.destroy_process_group()
    else:
        config = config.resolved()
        result = launch(train_worker, config.workers, config, threads_per_worker=config.threads)[0]
    return None if result is None else TrainReport.build(result["config"], result)
