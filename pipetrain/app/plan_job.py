"""Profiling and planning built-in models, as ``pipetrain profile``, ``plan`` and
``train --plan auto`` do."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Literal

import torch
import torch.distributed as dist

from pipetrain.app.arguments import progress_printer, say
from pipetrain.app.data import BatchStream
from pipetrain.app.message_costs import MessageCosts, measure_message_costs
from pipetrain.app.models import build_model, loss_function
from pipetrain.app.shared_cores import measure_shared_cores_factor, shared_cores
from pipetrain.planning import Plan, Topology, plan
from pipetrain.profiler import Profile, pooled
from pipetrain.profiler.collectives import measure_collectives
from pipetrain.profiler.links import combined, measure_links
from pipetrain.profiler.measure import profile
from pipetrain.units import counted, format_bandwidth, format_seconds

PROFILE_REPEATS, _WARMUP = 50, 5


def profile_builtin(
    model: str,
    batch_size: int,
    microbatches: int,
    seed: int = 0,
    threads: int = 1,
    repeats: int = PROFILE_REPEATS,
) -> Profile:
    """Profile a built-in model in this process on one micro-batch of its data, with
    ``threads`` torch threads as a local worker has, over ``repeats`` timed runs."""
    if batch_size < microbatches:
        raise ValueError(
            f"--batch-size {batch_size} is smaller than --microbatches {microbatches}; give "
            f"--batch-size {microbatches} or more"
        )
    torch.set_num_threads(threads)
    network = build_model(model, seed=seed)
    inputs, targets = next(BatchStream(model, batch_size, seed=seed))
    size = batch_size // microbatches
    measured = profile(
        network,
        inputs[:size],
        targets[:size],
        loss_function(model),
        microbatch_size=size,
        repeats=repeats,
        warmup=_WARMUP,
    )
    return replace(measured, model=model)


def profile_together(
    model: str,
    batch_size: int,
    microbatches: int,
    seed: int = 0,
    threads: int = 1,
    repeats: int = PROFILE_REPEATS,
    bandwidth: float = math.inf,
    other_counts: Sequence[int] = (),
) -> Profile | None:
    """Call on every rank of the default process group (gloo: the model is profiled on the
    CPU): every rank profiles the model at once (in turns of as many as there are cores,
    where :func:`shared_cores` finds them sharing fewer), at ``microbatches`` and at each of
    ``other_counts`` (its ``other_sizes``); rank 0 returns the pooled profile
    (:func:`pipetrain.profiler.pooled`) with what a message costs each side's core, fixed
    and per byte, between ranks 0 and 1 while the others compute (``message_s``,
    ``send_byte_s``, ``receive_byte_s``:
    :func:`~pipetrain.app.message_costs.measure_message_costs`, each round long enough
    for its message to cross a link of ``bandwidth`` bytes/s) and, where the ranks share
    cores, how much more core time a forward and backward of the model takes with every
    rank running than in turns (``shared_cores_factor``:
    :func:`~pipetrain.app.shared_cores.measure_shared_cores_factor`) and what the group's
    collectives cost (``collectives``:
    :func:`~pipetrain.profiler.collectives.measure_collectives`); other ranks ``None``.

    In a running pipeline every worker computes at once, and workers that share a machine
    slow each other down (memory bandwidth, caches), so costs measured on an idle machine
    would be optimistic.
    """
    # start together, so that every timing runs beside the others; ranks that share a
    # machine with fewer cores than ranks take turns, as many at once as there are cores
    # (the planner then models them sharing the cores)
    at_once = shared_cores(threads) or dist.get_world_size()
    turns = -(-dist.get_world_size() // at_once)
    counts = (microbatches, *other_counts)
    measured: Profile | None = None
    for turn in range(turns):
        dist.barrier()
        if dist.get_rank() // at_once != turn:
            continue
        profiles = []
        for index, count in enumerate(counts):
            if dist.get_rank() == turn * at_once:  # the turn's first rank speaks for it
                of_turns = f", ranks' turn {turn + 1} of {turns}" if turns > 1 else ""
                say(
                    f"profiling {model} at {counted(count, 'micro-batch', 'micro-batches')} "
                    f"({index + 1} of {len(counts)}{of_turns}) ..."
                )
            profiles.append(profile_builtin(model, batch_size, count, seed, threads, repeats))
        measured = replace(profiles[0], other_sizes=tuple(profiles[1:]))
    assert measured is not None  # every rank had a turn
    if at_once < dist.get_world_size() and dist.get_rank() == 0:
        say("measuring how much sharing the cores slows the ranks ...")
    slowdown = (
        measure_shared_cores_factor(
            _training_pass(model, batch_size // microbatches, seed), at_once
        )
        if at_once < dist.get_world_size()
        else 1.0
    )
    gathered: list[Profile] | None = (
        [measured] * dist.get_world_size() if dist.get_rank() == 0 else None
    )
    dist.gather_object(measured, gathered, dst=0)
    if dist.get_world_size() > 1 and dist.get_rank() == 0:
        say("measuring what a message costs each side ...")
    message = (
        MessageCosts(0.0, 0.0, 0.0)
        if dist.get_world_size() == 1
        else measure_message_costs(
            int(max(layer.activation_bytes for layer in measured.layers)), bandwidth
        )
    )
    if dist.get_world_size() > 1 and dist.get_rank() == 0:
        say("measuring what the collectives cost ...")
    collectives = measure_collectives()
    if gathered is None:
        return None
    return replace(
        pooled(gathered),
        collectives=collectives,
        message_s=message.fixed_s,
        send_byte_s=message.send_byte_s,
        receive_byte_s=message.receive_byte_s,
        shared_cores_factor=slowdown,
    )


def _training_pass(model: str, size: int, seed: int) -> Callable[[], None]:
    """A forward and backward of a built-in model on a micro-batch of ``size`` samples."""
    network = build_model(model, seed=seed)
    inputs, targets = next(BatchStream(model, size, seed=seed))
    loss_fn = loss_function(model)

    def run() -> None:
        network.zero_grad(set_to_none=True)
        loss_fn(network(inputs), targets).backward()

    return run


def plan_together(
    model: str,
    batch_size: int,
    seed: int = 0,
    threads: int = 1,
    schedules: Sequence[str] | None = None,
    memory_limit: float | None = None,
    shard: bool | Literal["only"] = True,
) -> Plan:
    """Call on every rank of the default process group (gloo): profile a built-in model on all
    ranks at once (:func:`profile_together`), measure the links between them before and
    after it (:func:`pipetrain.profiler.links.measure_links`, then
    :func:`~pipetrain.profiler.links.combined`), plan it on rank 0 for as many workers as the
    group has on that topology, among ``schedules`` (``None``: every one), within
    ``memory_limit`` bytes a worker (``None``: no limit), sharding replicated stages as
    ``shard`` says (:func:`pipetrain.planning.plan`), and return that plan on every rank.

    Profiling in the processes that will train ties the prediction to them: separate
    launches of the same work can run a third faster or slower than each other. The planner
    may halve or double the 4 micro-batches the profile is taken at, and the profile is
    measured at all three sizes: a sample costs more in a small micro-batch than in a large
    one, so scaling one size's times linearly to the others would be 15-25% off.
    """
    profiled = max(m for m in (1, 2, 4) if batch_size % m == 0)
    counts = tuple(
        m for m in (profiled // 2, profiled, profiled * 2) if m >= 1 and batch_size % m == 0
    )
    if dist.get_rank() == 0:
        say("measuring the links between the ranks ...")
    link = measure_links()
    measured = profile_together(
        model,
        batch_size,
        profiled,
        seed,
        threads,
        bandwidth=link.bandwidth,
        other_counts=[count for count in counts if count != profiled],
    )
    link = combined([link, measure_links()])  # the latency's regime changes over seconds
    cores = shared_cores(threads)
    if measured is None:
        return planned_on_rank_zero(None)
    sharing = (
        ""
        if cores is None
        else f"; the workers share {counted(cores, 'core')}, on which their work takes"
        f" {measured.shared_cores_factor:.2f}x the core time it takes alone"
    )
    print(
        f"links measured: {format_bandwidth(link.bandwidth)}, {format_seconds(link.latency_s)}"
        f" a message; a message keeps each side busy {format_seconds(measured.message_s)}"
        f" and {format_seconds(measured.send_byte_s * 1e6)} (sender),"
        f" {format_seconds(measured.receive_byte_s * 1e6)} (receiver) more a MB"
        + _collectives_text(measured)
        + sharing,
        file=sys.stderr,
        flush=True,
    )
    say("planning ...")
    return planned_on_rank_zero(
        lambda: plan(
            measured,
            topology=Topology.flat(dist.get_world_size(), *link),
            batch_size=batch_size,
            microbatches=counts,
            schedules=schedules,
            memory_limit=memory_limit,
            shard=shard,
            every_worker=True,  # the job has this many processes, each a worker
            shared_cores=cores,
            progress=progress_printer(),
        )
    )


def _collectives_text(measured: Profile) -> str:
    """``"; collectives a MB: all-reduce 1.1 ms, ..."`` (empty where none were measured)."""
    measured_costs = measured.collectives
    if measured_costs is None:
        return ""
    return (
        f"; collectives a MB over {measured_costs.ranks} ranks: all-reduce "
        f"{format_seconds(measured_costs.allreduce_byte_s * 1e6)}, all-gather "
        f"{format_seconds(measured_costs.gather_byte_s * 1e6)}, reduce-scatter "
        f"{format_seconds(measured_costs.reduce_scatter_byte_s * 1e6)}"
    )


def planned_on_rank_zero(make: Callable[[], Plan] | None) -> Plan:
    """Call on every rank: rank 0's ``make()`` (``None`` elsewhere) on every rank, or the
    ValueError or TypeError it raised raised on every rank (none waits for a plan)."""
    outcome: list[Plan | Exception | None] = [None]
    if make is not None:
        try:
            outcome = [make()]
        except (ValueError, TypeError) as error:
            outcome = [error]
    dist.broadcast_object_list(outcome, src=0)
    chosen = outcome[0]
    if isinstance(chosen, Exception):
        raise chosen
    assert chosen is not None  # rank 0 sent its plan
    return chosen
