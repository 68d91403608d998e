"""A training run of a built-in model, as ``pipetrain train`` does it.

:func:`run_training` checks the configuration, starts one local worker per stage with
:func:`pipetrain.launch` (or joins the process group that ``torchrun`` started), trains with
Adam (with an optional warm-up and cosine learning-rate schedule), evaluates on a fixed
held-out batch every ``eval_every`` steps, records a timeline of the last step, and
compares it with the simulator's prediction for the same schedule on the stage costs
measured in that timeline.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from functools import partial
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

from pipetrain.app.arguments import say, ticking
from pipetrain.app.corpus_plan import automatic_plan
from pipetrain.app.corpus_stream import CorpusStream, scanned
from pipetrain.app.data import BatchStream
from pipetrain.app.model_registry import model_spec
from pipetrain.app.models import build_model, example_inputs, loss_function
from pipetrain.app.models.gpt import gpt_token_loss
from pipetrain.app.run_settings import apply_new_settings, check_settings
from pipetrain.app.step_costs import agreed, pricer_for, profiled_gpt
from pipetrain.app.traffic import interface_bytes_sent, sent_since
from pipetrain.app.train_config import TrainConfig
from pipetrain.app.train_report import TrainReport
from pipetrain.app.train_resume import check_resumable, resume, save_if_due
from pipetrain.distributed.heartbeat import stop_beating
from pipetrain.distributed.io_threads import defer_gloo_io_threads
from pipetrain.distributed.parent import end_with_agent
from pipetrain.distributed.store import join_group
from pipetrain.runtime import ModelSource, Pipeline, RuntimeConfig, launch
from pipetrain.runtime.rank.batch import Data
from pipetrain.units import counted, format_seconds


class Progress:
    """Prints ``step i/N, loss, samples/s`` on a stream: rewritten in place on a terminal,
    otherwise one line about every tenth of the run, and at least every :data:`QUIET_S`
    seconds."""

    QUIET_S = 4.0
    """The longest a run goes without a progress line where steps are slow."""

    def __init__(
        self, steps: int, batch_size: int, stream: TextIO = sys.stderr, *, start: int = 0
    ) -> None:
        """Report on ``stream`` for a run of ``steps`` steps of ``batch_size`` samples that
        starts after step ``start`` (a resumed run)."""
        self.steps, self.batch_size, self.stream = steps, batch_size, stream
        self.interactive = stream.isatty()
        self.every = 1 if self.interactive else max(1, steps // 10)
        self._last_step, self._last_time = start, time.perf_counter()

    def update(self, step: int, loss: float) -> None:
        """Report that ``step`` (counted from 1) finished with ``loss``."""
        now = time.perf_counter()
        if step % self.every and step != self.steps and now - self._last_time < self.QUIET_S:
            return
        rate = (step - self._last_step) * self.batch_size / max(now - self._last_time, 1e-9)
        self._last_step, self._last_time = step, now
        line = f"step {step}/{self.steps}  loss {loss:.4f}  {rate:,.0f} samples/s"
        self.stream.write(f"\r{line}\033[K" if self.interactive else line + "\n")
        if self.interactive and step == self.steps:
            self.stream.write("\n")
        self.stream.flush()

    def evaluation(self, step: int, metrics: dict[str, float]) -> None:
        """Report the held-out metrics measured after ``step``, on a line of their own."""
        line = f"step {step}/{self.steps}  held-out " + "  ".join(
            f"{name} {value:.4f}" for name, value in metrics.items() if name != "step"
        )
        self.stream.write(f"\r{line}\033[K\n" if self.interactive else line + "\n")
        self.stream.flush()


def held_out(config: TrainConfig, outputs: Any, targets: torch.Tensor) -> dict[str, float]:
    """Held-out loss (a token mean on a corpus of one's own), and for the digits
    classifiers the accuracy (a fraction)."""
    total, count = _loss(config)(outputs, targets), 1
    if isinstance(total, tuple):
        total, count = total
    metrics = {"loss": float(total / count)}
    if not model_spec(config.model).text:
        metrics["accuracy"] = float((outputs.argmax(dim=1) == targets).float().mean())
    return metrics


def train_worker(config: TrainConfig) -> dict[str, Any] | None:
    """Train on this rank of the process group; rank 0 returns the configuration it ran
    (with the plan's settings, for ``plan_auto``), losses, step times and the last step's
    timeline (as a dict), other ranks ``None``."""
    if dist.get_rank() == 0:
        announce("started")
    if config.plan_auto:
        # profile with the threads this worker trains with (torchrun's setting, under torchrun)
        with ticking("profiling and planning") if dist.get_rank() == 0 else _quiet():
            chosen = automatic_plan(config, torch.get_num_threads())
        if dist.get_rank() == 0:
            print(chosen.describe() + "\n", file=sys.stderr, flush=True)
        config = replace(config, plan_auto=False, plan=chosen).resolved(dist.get_world_size())
    built_at = time.perf_counter()
    talking = dist.get_rank() == 0
    if talking:
        captured = model_spec(config.model).captured
        say(
            f"{'capturing' if captured else 'building'} {config.model} and its stages on "
            f"{counted(dist.get_world_size(), 'rank')} ..."
        )
    with ticking("building") if talking else _quiet():
        pipe = _pipeline(config)
    if dist.get_rank() == 0:
        say(f"pipeline ready in {format_seconds(time.perf_counter() - built_at)}; training ...")
    batches = _stream(config, pipe)
    # a fixed held-out batch, read where the inputs are (and on rank 0, which reports)
    held = batches.eval_set() if batches is not None and config.eval_every else None
    history = resume(pipe, config, batches)  # from the newest checkpoint, if there is one
    new_seed = apply_new_settings(pipe, config)
    if new_seed and batches is not None and config.data is None:  # a new order
        batches = BatchStream(config.model, config.samples, seed=config.seed)
    progress = (
        Progress(config.steps, config.samples, start=history.steps)
        if dist.get_rank() == 0
        else None
    )
    sent_before = interface_bytes_sent()
    tokens: list[int] = []  # counted in each step's targets, for a corpus of one's own
    for step in range(history.steps, config.steps):
        inputs: Data | None = None
        targets: Data | None = None
        if batches is not None:
            inputs, targets = batches.__next__()
            if isinstance(batches, CorpusStream):
                tokens.append(batches.tokens(targets))
        # recording costs a barrier per step, so only the last step is recorded
        pipe.recorder.enabled = step == config.steps - 1
        start = time.perf_counter()
        update = (step + 1) % config.accumulate == 0 or step == config.steps - 1
        history.losses.append(pipe.train_step(inputs, targets, update=update))
        history.step_times_s.append(time.perf_counter() - start)
        if progress is not None:
            progress.update(step + 1, history.losses[-1])
        if config.eval_every and (step + 1) % config.eval_every == 0:
            # evaluation is left out of the recorded last step's timeline
            recording, pipe.recorder.enabled = pipe.recorder.enabled, False
            outputs = pipe.eval_step(None if held is None else held[0], to=0)
            pipe.recorder.enabled = recording
            if held is not None and outputs is not None:
                metrics = held_out(config, outputs, held[1])
                history.evaluations.append({"step": step + 1, **metrics})
                if progress is not None:
                    progress.evaluation(step + 1, history.evaluations[-1])
            # every rank starts the next step together: rank 0's metrics and progress
            # lines would otherwise count in the ranks' next step
            dist.barrier()
        save_if_due(pipe, config, batches, history)
    sent = sent_since(sent_before)
    if dist.get_rank() == 0:
        say("gathering the last step's timeline from every rank ...")
    with ticking("gathering") if dist.get_rank() == 0 else _quiet():
        timeline = pipe.timeline()
    if timeline is None:
        return None
    announce("finished")
    return {
        "config": config,
        "losses": history.losses,
        "step_times_s": history.step_times_s,
        "timeline": timeline.to_dict(),
        "eval": history.evaluations,
        "bytes_sent": sent,
        "tokens": tokens,
        "shapes": batches.shapes if isinstance(batches, CorpusStream) else [],
        "choices": batches.choices if isinstance(batches, CorpusStream) else [],
    }


def _stream(config: TrainConfig, pipe: Pipeline) -> BatchStream | CorpusStream | None:
    """This rank's training data: the input stage's ranks read it, and, for a corpus of
    one's own (targets of every length stay where they are read), the last stage's too."""
    if config.data is None:
        # the targets travel from the input stage to the last
        return (
            BatchStream(config.model, config.samples, seed=config.seed)
            if 0 in pipe.stages
            else None
        )
    data = config.data
    if config.length_costs is not None:  # under torchrun every rank profiled its own
        config = replace(config, length_costs=agreed(config.length_costs))
    if 0 in pipe.stages or pipe.schedule.stages - 1 in pipe.stages:
        return CorpusStream(
            data,
            config.samples,
            config.pipeline.microbatches,
            budget=config.pipeline.microbatch_tokens,
            pricer=pricer_for(config) if config.adaptive else None,
        )
    return None


def _loss(config: TrainConfig) -> Callable[..., Any]:
    return loss_function(config.model) if config.data is None else gpt_token_loss


def _pipeline(config: TrainConfig) -> Pipeline:
    """This rank's pipeline of ``config``'s model, as ``pipetrain train`` trains it."""
    factor = config.lr_factor()
    data = config.data
    # the GPT's vocabulary and context are the corpus's
    shape = {} if data is None else {"vocab": data.vocabulary(), "context": data.seq_len_max}
    return Pipeline(
        build_model(config.model, seed=config.seed, **shape),
        loss_fn=_loss(config),
        optimizer=partial(torch.optim.Adam, lr=config.learning_rate),
        config=config.worker_pipeline(),
        update=replace(
            config.update,
            lr_scheduler=None if factor is None else partial(LambdaLR, lr_lambda=factor),
        ),
        runtime=RuntimeConfig(timeout_s=config.timeout_s),
        source=ModelSource(example_inputs=example_inputs(config.model)),
    )


def _quiet() -> contextlib.AbstractContextManager[None]:
    """Where another rank talks: no progress lines."""
    return contextlib.nullcontext()


_TALK_DIRECTORY = "PIPETRAIN_TALK_DIRECTORY"
"""The environment variable naming the directory where rank 0 of local workers marks when
it starts talking (``started``) and when it is done (``finished``), so that the launching
process says what happens while rank 0 does not: the ranks starting, then ending."""


def announce(event: str) -> None:
    """Tell the launching process (if it is listening) that rank 0 has ``"started"``
    (and so talks) or ``"finished"`` (and the ranks end): called by rank 0 of every worker
    function given to :func:`run_on_workers`."""
    directory = os.environ.get(_TALK_DIRECTORY)
    if directory:
        with contextlib.suppress(OSError):
            open(os.path.join(directory, event), "x").close()


def _launch_phase(directory: str) -> str | None:
    """What the launching process says while local workers run: ``None`` while rank 0
    talks."""
    if os.path.exists(os.path.join(directory, "finished")):
        return "ending the ranks"
    return None if os.path.exists(os.path.join(directory, "started")) else "starting"


def run_on_workers(
    worker: Callable[[TrainConfig], dict[str, Any] | None],
    config: TrainConfig,
    ready: Callable[[TrainConfig, int | None], TrainConfig],
) -> tuple[TrainConfig, dict[str, Any] | None]:
    """Run ``worker`` on every rank with the configuration ``ready`` fills in and checks for
    the world size (``None``: before local workers start); return that configuration and
    rank 0's result (``None`` on other torchrun ranks).

    Under ``torchrun`` (``WORLD_SIZE`` set) it runs in this process on the existing process
    group (a gloo group is started if none is, listening only where needed:
    :func:`~pipetrain.distributed.store.join_group`), with ``config.threads`` torch threads,
    and ends when torchrun's agent dies;
    otherwise it launches ``config.workers`` local workers with that many threads each.
    Every receive and collective waits at most ``config.timeout_s``.
    """
    if "WORLD_SIZE" not in os.environ:
        config = ready(config, None)  # before any worker starts
        say(
            f"starting {counted(config.workers, 'rank')} (worker processes; each imports "
            "torch and joins the process group) ..."
        )
        with tempfile.TemporaryDirectory(prefix="pipetrain-") as directory:
            os.environ[_TALK_DIRECTORY] = directory  # the workers inherit it
            try:
                with ticking(partial(_launch_phase, directory)):
                    result = launch(
                        worker,
                        config.workers,
                        config,
                        threads_per_worker=config.threads,
                        timeout_s=config.timeout_s,
                    )[0]
            finally:
                del os.environ[_TALK_DIRECTORY]
        return config, result
    end_with_agent()  # a SIGKILLed torchrun agent must not leave this worker training
    started_group = not dist.is_initialized()
    if started_group:
        join_group("gloo", timedelta(seconds=config.timeout_s))
        defer_gloo_io_threads()
    torch.set_num_threads(config.threads)
    try:
        config = ready(config, dist.get_world_size())
        return config, worker(config)
    finally:
        if started_group:
            stop_beating()
            dist.destroy_process_group()


def _ready(config: TrainConfig, world_size: int | None) -> TrainConfig:
    config = config.resolved(world_size=world_size)
    check_resumable(config)
    check_settings(config)
    if config.data is not None:  # bad data is named before any worker starts
        say(f"reading {config.data.path} once to check it ...")
        with ticking("checking the corpus"):
            summary = scanned(config.data)
        say(
            f"{counted(summary.training, 'training document')} and "
            f"{summary.held_out} held out, {counted(summary.tokens, 'token')}, the longest "
            f"{summary.longest}" + (f" ({summary.truncated} cut)" if summary.truncated else "")
        )
        say("profiling the GPT at 5 sequence lengths for the step cost model ...")
        with ticking("profiling"):
            fitted = profiled_gpt(config.data, config.seed, config.threads)
        config = replace(config, length_costs=fitted)
    return config


def run_training(config: TrainConfig) -> TrainReport | None:
    """Train as ``config`` says and report; ``None`` on torchrun ranks other than 0 (see
    :func:`run_on_workers`)."""
    _, result = run_on_workers(train_worker, config, _ready)
    if result is None:
        return None
    say("simulating the last step on its measured costs for the report ...")
    with ticking("writing the report"):
        return TrainReport.build(result["config"], result)
