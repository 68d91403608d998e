"""Profiling and planning built-in models, as ``pipetrain profile``, ``plan`` and ``train --plan auto`` do."""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from pipetrain.data import BatchStream
from pipetrain.models import build_model, loss_function
from pipetrain.plan import Plan, plan
from pipetrain.profiler import Profile, pooled
from pipetrain.profiler.measure import profile
from pipetrain.runtime import launch
from pipetrain.runtime.transport import Transport

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKMGT]?)(i?)B?\s*$")
_POWERS = {"": 0, "k": 1, "K": 1, "M": 2, "G": 3, "T": 4}


def parse_bytes(text: str) -> float:
    """``"16GiB"`` -> 17179869184, ``"500MB"`` -> 5e8, ``"1024"`` -> 1024; ValueError otherwise."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"memory size {text!r} is not a size; write it like 16GiB, 500MB or 1e9 (bytes)") from None
    number, prefix, binary = match.groups()
    return float(number) * (1024 if binary else 1000) ** _POWERS[prefix]


PROFILE_REPEATS, _WARMUP = 50, 5
# separate launches of the same work can differ by a third in speed, each keeping its own
# for its lifetime: a profile pools several launches to average that out
PROFILE_LAUNCHES = 3


def profile_builtin(model: str, batch_size: int, microbatches: int, seed: int = 0, threads: int = 1,
                    workers: int = 1) -> Profile:
    """Profile a built-in model on one micro-batch of its data, with ``threads`` torch
    threads as a local worker has.

    With ``workers`` > 1, that many local processes profile the model at the same time and
    their profiles are pooled (:func:`pipetrain.profiler.pooled`): in a running pipeline
    every worker computes at once, and workers that share a machine slow each other down
    (memory bandwidth, caches), so costs measured on an idle machine would be optimistic.
    Two of them then time activation messages between them (``message_s``). This is done
    in several launches of fresh processes, with the repeats shared out among them, and
    all their profiles are pooled: a process keeps the speed it happened to start with, and
    one launch can be a third faster or slower than the next.
    """
    if batch_size < microbatches:
        raise ValueError(f"batch size {batch_size} is smaller than microbatches {microbatches}")
    if workers > 1:
        repeats = -(-PROFILE_REPEATS // PROFILE_LAUNCHES)
        launched = [
            launch(_profile_together, workers, model, batch_size, microbatches, seed, threads, repeats,
                   threads_per_worker=threads)[0]
            for _ in range(PROFILE_LAUNCHES)
        ]
        return replace(pooled(launched), message_s=statistics.mean(p.message_s for p in launched))
    return _profile_here(model, batch_size, microbatches, seed, threads, PROFILE_REPEATS)


def _profile_here(model: str, batch_size: int, microbatches: int, seed: int, threads: int, repeats: int) -> Profile:
    """Profile a built-in model in this process, ``repeats`` timed runs after warm-up."""
    torch.set_num_threads(threads)
    network = build_model(model, seed=seed)
    inputs, targets = next(BatchStream(model, batch_size, seed=seed))
    size = batch_size // microbatches
    return profile(network, inputs[:size], targets[:size], loss_function(model), microbatch_size=size,
                   repeats=repeats, warmup=_WARMUP)


def _profile_together(model: str, batch_size: int, microbatches: int, seed: int, threads: int,
                      repeats: int) -> Profile | None:
    """Every rank profiles the model at once; rank 0 returns the pooled profile, with the
    time activation messages take between ranks 0 and 1."""
    dist.barrier()  # start together, so that every timing runs beside the others
    measured = _profile_here(model, batch_size, microbatches, seed, threads, repeats)
    gathered: list[Profile] | None = [measured] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(measured, gathered, dst=0)
    message_s = _message_s(int(statistics.median(layer.activation_bytes for layer in measured.layers)))
    return replace(pooled(gathered), message_s=message_s) if gathered is not None else None


def _message_s(nbytes: int, rounds: int = 24, warmup: int = 4) -> float:
    """The longer of the median times a message of ``nbytes`` keeps rank 0 sending and rank 1
    receiving it (the data already there), as the pipeline's transport does it."""
    rank = dist.get_rank()
    transport = Transport(torch.device("cpu"))
    payload = (torch.zeros(max(1, nbytes // 4)),)
    times = []
    for round_index in range(warmup + rounds):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            transport.send(payload, 1, "message")
            elapsed = time.perf_counter() - start
            transport.flush()
        elif rank == 1:
            time.sleep(0.002)  # let the data arrive: a receive that waits would time the wait
            start = time.perf_counter()
            transport.receive(0, "message")
            elapsed = time.perf_counter() - start
        else:
            elapsed = 0.0
        if round_index >= warmup:
            times.append(elapsed)
    longest = torch.tensor([statistics.median(times)])
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    return float(longest)


def auto_plan(model: str, workers: int, batch_size: int, seed: int = 0, threads: int = 1) -> Plan:
    """Profile a built-in model and plan it for ``workers`` local workers at ``batch_size``.

    The profile is taken at 4 micro-batches and the planner may halve or double that: a
    profile scales times linearly with the micro-batch size, which holds near the measured
    size but not for tiny micro-batches, whose fixed costs it would leave out.
    """
    profiled = max(m for m in (1, 2, 4) if batch_size % m == 0)
    counts = tuple(m for m in (profiled // 2, profiled, profiled * 2) if m >= 1 and batch_size % m == 0)
    measured = profile_builtin(model, batch_size, profiled, seed, threads, workers)
    return plan(measured, workers=workers, batch_size=batch_size, microbatches=counts)
