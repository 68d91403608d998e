"""``pipetrain train --plan auto``'s plan, and for ``--data PATH`` one chosen on the corpus's
own lengths.

The GPT's per-layer costs are fitted to tokens and length² before the workers start
(:mod:`pipetrain.profiler.lengths`). Here rank 0 reads the corpus's first steps, forms
their micro-batches at each micro-batch count the planner may choose (consecutive groups
padded each to its longest, or packed rows, as the run forms them), and hands the planner
one profile per count whose layer times are the fitted costs' mean over those
micro-batches: the padding a count wastes and attention's length² are in what it compares.
Activation and parameter bytes come from one profile of the GPT at a middle shape.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from pipetrain.app.arguments import progress_printer, say
from pipetrain.app.corpus_stream import CorpusSettings
from pipetrain.app.models import build_model
from pipetrain.app.models.gpt import gpt_token_loss
from pipetrain.app.plan_job import plan_together, planned_on_rank_zero
from pipetrain.app.shared_cores import shared_cores
from pipetrain.app.step_costs import agreed, shapes_of
from pipetrain.app.train_config import TrainConfig
from pipetrain.data.batches import fixed_groups, pack_groups
from pipetrain.planning import Plan, Topology, plan
from pipetrain.profiler import Profile
from pipetrain.profiler.lengths import LengthCosts, Shape
from pipetrain.profiler.links import measure_links
from pipetrain.profiler.measure import profile
from pipetrain.units import counted

SAMPLED_STEPS = 8
"""The corpus's first steps whose micro-batches the planner prices."""
COUNTS = (1, 2, 4, 8, 16)
"""The micro-batch counts the planner may choose (those dividing the batch size)."""


def sampled_lengths(data: CorpusSettings, batch_size: int) -> list[list[int]]:
    """The input lengths of the documents of the corpus's first :data:`SAMPLED_STEPS`
    steps (fewer in a short corpus), as the run reads them."""
    batches = data.open().batches(batch_size)
    return [
        [max(1, len(ids) - 1) for ids in step] for step in itertools.islice(batches, SAMPLED_STEPS)
    ]


def microbatch_shapes(lengths: Sequence[int], count: int, pack: int | None) -> list[Shape]:
    """The ``(rows, length)`` of each of a step's ``count`` micro-batches: consecutive
    groups padded each to its longest, or (``pack``: the row capacity) packed rows all as
    wide as the step's widest."""
    if pack is None:
        return shapes_of(lengths, fixed_groups(len(lengths), count))
    rows = pack_groups(lengths, pack, count)
    width = max(sum(lengths[i] for i in row) for row in rows)
    return [(len(group), width) for group in fixed_groups(len(rows), count)]


def corpus_profile(
    fitted: LengthCosts,
    base: Profile,
    base_shape: Shape,
    steps: Sequence[Sequence[int]],
    batch_size: int,
    pack: int | None,
) -> Profile:
    """A profile of the GPT for each micro-batch count of :data:`COUNTS` dividing
    ``batch_size`` (the fewest micro-batches' first, the others its ``other_sizes``),
    priced on the micro-batches ``steps`` form at that count."""
    counts = [m for m in COUNTS if batch_size % m == 0]
    profiles = []
    for count in counts:
        try:
            shapes = [s for lengths in steps for s in microbatch_shapes(lengths, count, pack)]
        except ValueError:  # too few documents to pack into that many rows
            continue
        profiles.append(fitted.profile(base, base_shape, shapes, batch_size // count))
    if not profiles:
        raise ValueError(
            f"a batch of {batch_size} documents packs into too few rows for any micro-batch "
            "count; give a larger --batch-size"
        )
    first, *others = profiles
    return replace(first, other_sizes=tuple(others), model="gpt")


def base_profile(config: TrainConfig, shape: Shape) -> Profile:
    """The run's GPT profiled once on random tokens of ``shape`` (for its bytes)."""
    data = config.data
    assert data is not None
    vocabulary = data.vocabulary()
    model = build_model("gpt", seed=config.seed, vocab=vocabulary, context=data.seq_len_max)
    tokens = torch.randint(0, vocabulary, shape, generator=torch.Generator().manual_seed(0))
    return profile(model, tokens, tokens, lambda out, y: gpt_token_loss(out, y)[0], repeats=1)


def plan_on_corpus(config: TrainConfig, threads: int) -> Plan:
    """Call on every rank of a ``--data --plan auto`` run (its costs fitted): measure the
    links, and plan on rank 0 for every rank on the corpus's first steps; every rank
    returns that plan."""
    assert config.length_costs is not None and config.data is not None
    fitted = agreed(config.length_costs)
    link = measure_links()
    cores = shared_cores(threads)
    if dist.get_rank() != 0:
        return planned_on_rank_zero(None)
    data = config.data
    say(f"reading the first {SAMPLED_STEPS} steps of {data.path} to price their micro-batches ...")
    steps = sampled_lengths(data, config.samples)
    every = [length for lengths in steps for length in lengths]
    shape = (max(1, config.samples // 4), max(1, int(statistics.median(every))))
    pack = data.seq_len_max if data.pack else None
    say("planning on the fitted costs of those micro-batches ...")

    def made() -> Plan:
        measured = corpus_profile(
            fitted, base_profile(config, shape), shape, steps, config.samples, pack
        )
        return plan(
            measured,
            topology=Topology.flat(dist.get_world_size(), *link),
            batch_size=config.samples,
            microbatches=[
                config.samples // p.microbatch_size for p in (measured, *measured.other_sizes)
            ],
            schedules=config.plan_schedules,
            memory_limit=config.plan_memory,
            shard="only" if config.pipeline.shard else True,
            every_worker=True,
            shared_cores=cores,
            progress=progress_printer(),
        )

    return planned_on_rank_zero(made)


def automatic_plan(config: TrainConfig, threads: int) -> Plan:
    """Call on every rank of a ``--plan auto`` run: its plan, on every rank. For ``--data``,
    :func:`plan_on_corpus`; otherwise every rank profiles the built-in model at once and
    rank 0 plans (:func:`~pipetrain.app.plan_job.plan_together`)."""
    if config.data is not None:
        return plan_on_corpus(config, threads)
    if dist.get_rank() == 0:
        say(
            f"profiling {config.model} on {counted(dist.get_world_size(), 'rank')} at once, "
            "then planning ..."
        )
    return plan_together(
        config.model,
        config.samples,
        config.seed,
        threads,
        schedules=config.plan_schedules,
        memory_limit=config.plan_memory,
        shard="only" if config.pipeline.shard else True,
    )
