"""Profiling and planning built-in models, as ``pipetrain profile``, ``plan`` and ``train --plan auto`` do."""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from pipetrain.data import BatchStream
from pipetrain.models import build_model, loss_function
from pipetrain.plan import Plan, plan
from pipetrain.profiler import Profile
from pipetrain.profiler.measure import profile
from pipetrain.runtime import launch

_PROFILED = "pipetrain/profiled"
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKMGT]?)(i?)B?\s*$")
_POWERS = {"": 0, "k": 1, "K": 1, "M": 2, "G": 3, "T": 4}


def parse_bytes(text: str) -> float:
    """``"16GiB"`` -> 17179869184, ``"500MB"`` -> 5e8, ``"1024"`` -> 1024; ValueError otherwise."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"memory size {text!r} is not a size; write it like 16GiB, 500MB or 1e9 (bytes)") from None
    number, prefix, binary = match.groups()
    return float(number) * (1024 if binary else 1000) ** _POWERS[prefix]


def profile_builtin(model: str, batch_size: int, microbatches: int, seed: int = 0, threads: int = 1,
                    workers: int = 1) -> Profile:
    """Profile a built-in model on one micro-batch of its data, with ``threads`` torch
    threads as a local worker has.

    With ``workers`` > 1 the profile is taken while ``workers − 1`` other local processes
    train the same model as background load: in a running pipeline every worker computes
    at the same time, and workers that share a machine slow each other down (memory
    bandwidth, caches), so costs measured on an idle machine would be optimistic.
    """
    if batch_size < microbatches:
        raise ValueError(f"batch size {batch_size} is smaller than microbatches {microbatches}")
    if workers > 1:
        return launch(_profile_under_load, workers, model, batch_size, microbatches, seed, threads, threads_per_worker=threads)[0]
    torch.set_num_threads(threads)
    network = build_model(model, seed=seed)
    inputs, targets = next(BatchStream(model, batch_size, seed=seed))
    size = batch_size // microbatches
    return profile(network, inputs[:size], targets[:size], loss_function(model), microbatch_size=size, repeats=15, warmup=3)


def _profile_under_load(model: str, batch_size: int, microbatches: int, seed: int, threads: int) -> Profile | None:
    """Rank 0 profiles; the other ranks run forward and backward passes until it is done."""
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        try:
            return profile_builtin(model, batch_size, microbatches, seed, threads)
        finally:
            store.set(_PROFILED, "1")
    network, loss_fn = build_model(model, seed=seed), loss_function(model)
    inputs, targets = next(BatchStream(model, batch_size, seed=seed))
    size = batch_size // microbatches
    while not store.check([_PROFILED]):
        loss_fn(network(inputs[:size]), targets[:size]).backward()
    return None


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
