"""``pipetrain train --ddp``: the data-parallel baseline for a pipeline run.

The same built-in model, global batch, Adam, learning-rate policy, accumulation and
clipping as ``pipetrain train``, trained with
:class:`torch.nn.parallel.DistributedDataParallel`: one whole replica per worker, each
worker computing the mean loss of its equal share of every batch, the gradients averaged
over the workers. Equal shards of a mean loss make the averaged gradient the full batch's,
so the losses are the unpipelined loop's. Local workers come from :func:`pipetrain.launch`;
under ``torchrun`` (``WORLD_SIZE`` set) each process is one worker.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR

from pipetrain.app.data import BatchStream
from pipetrain.app.model_registry import model_spec
from pipetrain.app.models import build_model, loss_function
from pipetrain.app.traffic import interface_bytes_sent, sent_since
from pipetrain.app.train_config import DEFAULT_RANKS, WARMUP_STEPS, TrainConfig, warmup_cosine
from pipetrain.app.train_job import Progress, announce, held_out, run_on_workers
from pipetrain.app.train_report import divergence, run_keys
from pipetrain.units import counted, format_seconds

DDP_PRECISIONS = ("fp32", "bf16")


def resolve_ddp(config: TrainConfig, world_size: int | None = None) -> TrainConfig:
    """``config`` for data parallelism: workers (``ranks``), batch and learning rate filled
    in; a ValueError naming any setting that only a pipeline has, or a batch that does not
    split into equal shards."""
    model = model_spec(config.model)
    pipeline, default = config.pipeline, TrainConfig(config.model).pipeline
    pipeline_only = {
        "--plan": config.plan is not None or config.plan_auto,
        "--replicas": pipeline.replicas is not None,
        "--balance": pipeline.balance is not None,
        "--recompute": pipeline.recompute != "never",
        "--schedule": pipeline.schedule != default.schedule,
        "schedule options": bool(pipeline.schedule_options),
        "--data-parallel": pipeline.data_parallel != 1,
        "--shard": pipeline.shard,
        "--tensor-parallel": pipeline.tensor_parallel != 1,
    }
    given = [name for name, present in pipeline_only.items() if present]
    if given:
        raise ValueError(
            f"{', '.join(given)} set a pipeline, which --ddp does not run; leave them out"
        )
    if config.update.precision not in DDP_PRECISIONS:
        raise ValueError(
            f"--ddp trains in {' or '.join(DDP_PRECISIONS)}, not {config.update.precision}; "
            "give --precision bf16 or leave it out"
        )
    workers = config.ranks or world_size or DEFAULT_RANKS
    if world_size is not None and workers != world_size:
        raise ValueError(
            f"--ranks {workers} differs from the torchrun world size {world_size}; "
            f"give --ranks {world_size} or omit it"
        )
    batch = config.batch_size or model.batch_size
    if batch % workers:
        raise ValueError(
            f"--ddp splits each batch of {batch} samples into {workers} equal shards; "
            f"give a --batch-size divisible by {workers}"
        )
    for name in ("steps", "accumulate", "threads"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be a positive integer, got {getattr(config, name)}")
    if not config.timeout_s > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {config.timeout_s}")
    return replace(config, ranks=workers, batch_size=batch, lr=config.lr or model.lr)


def ddp_worker(config: TrainConfig) -> dict[str, Any] | None:
    """Train this rank's replica on its shard of every batch; rank 0 returns the losses
    (the full batch's mean, averaged over the shards), step times and held-out metrics,
    other ranks ``None``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        announce("started")
    model = build_model(config.model, seed=config.seed)
    replica = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(replica.parameters(), lr=config.learning_rate)
    updates = -(-config.steps // config.accumulate)
    scheduler = (
        None if config.lr_schedule == "constant" else LambdaLR(optimizer, warmup_cosine(updates))
    )
    loss_fn = loss_function(config.model)
    batches = BatchStream(config.model, config.samples, seed=config.seed)
    share = config.samples // world
    shard = slice(rank * share, (rank + 1) * share)
    held = batches.eval_set() if rank == 0 and config.eval_every else None
    progress = Progress(config.steps, config.samples) if rank == 0 else None
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if config.update.precision == "bf16"
        else contextlib.nullcontext()
    )
    losses: list[float] = []
    step_times: list[float] = []
    evaluations: list[dict[str, float]] = []
    sent_before = interface_bytes_sent()
    for step in range(config.steps):
        inputs, targets = next(batches)
        update = (step + 1) % config.accumulate == 0 or step == config.steps - 1
        start = time.perf_counter()
        # gradients of a step without an update accumulate locally, averaged at the update
        with replica.no_sync() if not update else contextlib.nullcontext():
            with autocast:
                outputs = replica(inputs[shard])
            loss = loss_fn(outputs.float(), targets[shard])
            loss.backward()
        if update:
            if config.update.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(replica.parameters(), config.update.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        step_times.append(time.perf_counter() - start)
        if progress is not None:
            progress.update(step + 1, losses[-1])
        if config.eval_every and (step + 1) % config.eval_every == 0:
            if held is not None:
                with torch.no_grad():
                    outputs = model.eval()(held[0])
                model.train()
                evaluations.append({"step": step + 1, **held_out(config, outputs, held[1])})
                if progress is not None:
                    progress.evaluation(step + 1, evaluations[-1])
            # rank 0 evaluates alone: the others would wait for it inside the next step,
            # whose time on rank 0, the one reported, would then leave that wait out
            dist.barrier()
    sent = sent_since(sent_before)
    if rank != 0:
        return None
    announce("finished")
    return {"losses": losses, "step_times_s": step_times, "eval": evaluations, "bytes_sent": sent}


@dataclass(frozen=True)
class DDPReport:
    """The outcome of a data-parallel run: losses, step times and held-out metrics."""

    config: TrainConfig
    losses: list[float]
    step_times_s: list[float]
    evaluations: list[dict[str, float]] = field(default_factory=list)
    bytes_sent: list[int] = field(default_factory=list)

    @property
    def step_s(self) -> float:
        """Median step time in seconds, leaving out the warm-up steps when there are more."""
        return statistics.median(self.step_times_s[WARMUP_STEPS:] or self.step_times_s)

    @property
    def samples_per_s(self) -> float:
        """Training samples per second at the median step time."""
        return self.config.samples / self.step_s

    def to_json(self) -> dict[str, Any]:
        """The JSON object of ``pipetrain train --ddp --json``: the keys of a pipeline run's
        report that mean something without a pipeline, ``schedule`` being ``"ddp"``."""
        config = self.config
        return {
            **run_keys(
                config,
                self.losses,
                self.step_times_s,
                self.evaluations,
                self.step_s,
                self.bytes_sent,
            ),
            "schedule": "ddp",
            "ddp": True,
            "ranks": config.ranks,
        }

    def divergence(self) -> str | None:
        """Why the run counts as diverged (as a pipeline run's report decides), or ``None``."""
        return divergence(self.losses)

    def summary(self) -> str:
        """A few readable lines: workers, loss, step time and throughput."""
        config = self.config
        share = config.samples // (config.ranks or 1)
        held = [
            f"  held-out          after step {last['step']:g}: "
            + ", ".join(f"{name} {value:.4f}" for name, value in last.items() if name != "step")
            for last in self.evaluations[-1:]
        ]
        return "\n".join(
            [
                f"{config.model}, data-parallel (DDP) on {counted(config.ranks or 1, 'rank')}, "
                f"{share} of {config.samples} samples each, {counted(config.steps, 'step')} "
                f"(Adam, lr {config.lr:g}, {config.lr_schedule}, {config.update.precision})",
                f"  loss              {self.losses[0]:.4f} -> {self.losses[-1]:.4f}",
                *held,
                f"  step time         {format_seconds(self.step_s)} (median)",
                f"  throughput        {self.samples_per_s:,.0f} samples/s",
            ]
        )


def run_ddp_training(config: TrainConfig) -> DDPReport | None:
    """Train ``config`` data-parallel and report; ``None`` on torchrun ranks other than 0.
    Each worker takes ``config.threads`` torch threads (under torchrun too), and every
    collective waits at most ``config.timeout_s`` (see :func:`run_on_workers`)."""
    config, result = run_on_workers(ddp_worker, config, resolve_ddp)
    if result is None:
        return None
    return DDPReport(
        config, result["losses"], result["step_times_s"], result["eval"], result["bytes_sent"]
    )
