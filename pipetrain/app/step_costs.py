"""Each step of ``pipetrain train --data`` priced by the length-aware cost model: the
report's prediction step by step, and ``--adaptive``'s choice of how a step's documents
form micro-batches.

The GPT's layers are profiled alone at five shapes up to ``--seq-len-max``
(:func:`profiled_gpt`) and fitted (:mod:`pipetrain.profiler.lengths`); a
:class:`StepPricer` simulates a step of given micro-batch shapes under the run's schedule.
``--adaptive`` simulates every candidate formation of a step (:func:`candidates`) and
keeps the fastest: all of them compute the same token-mean loss, so the choice changes
the time only.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from pipetrain.app.models import build_model
from pipetrain.app.models.gpt import gpt_token_loss
from pipetrain.data.batches import fixed_groups, token_budget_groups
from pipetrain.planning.sharing import shared_cores_stretch
from pipetrain.profiler import Profile, profile
from pipetrain.profiler.lengths import LengthCosts, Shape, measure_lengths
from pipetrain.schedules import build
from pipetrain.simulation import Costs, simulate
from pipetrain.timeline import Timeline

if TYPE_CHECKING:
    from pipetrain.app.corpus_stream import CorpusSettings
    from pipetrain.app.train_config import TrainConfig

BUDGET_FACTORS = (0.5, 1.0, 2.0)  # --adaptive tries these multiples of the token budget
CALIBRATION_WINDOW = 32  # steps whose measured/predicted ratios correct the next prediction


def profile_shapes(seq_len_max: int) -> list[Shape]:
    """Five ``(rows, length)`` shapes spanning the lengths a corpus run meets."""
    top = seq_len_max
    return [(2, max(1, top // 16)), (2, max(1, top // 4)), (2, top), (8, max(1, top // 8)),
            (4, max(1, top // 2))]  # fmt: skip


def profiled_gpt(data: CorpusSettings, seed: int, threads: int) -> LengthCosts:
    """The run's GPT (the corpus's vocabulary and context) profiled layer by layer at
    :func:`profile_shapes` on random tokens with ``threads`` torch threads (a rank's), and
    fitted."""
    vocabulary = data.vocabulary()
    model = build_model("gpt", seed=seed, vocab=vocabulary, context=data.seq_len_max)
    generator = torch.Generator().manual_seed(seed)

    def at(shape: Shape) -> Profile:
        tokens = torch.randint(0, vocabulary, shape, generator=generator)
        return profile(model, tokens, tokens, lambda out, y: gpt_token_loss(out, y)[0])

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return measure_lengths(at, profile_shapes(data.seq_len_max))
    finally:
        torch.set_num_threads(before)


def calibrated(predicted: Sequence[float], measured: Sequence[float], skip: int) -> list[float]:
    """Each step's prediction times the median of measured / predicted over the up to
    :data:`CALIBRATION_WINDOW` steps before it, leaving out the first ``skip`` (warm-up):
    the profiled model's steady error (a profile taken once, alone, before the run),
    learnt from the steps already made and never from the step predicted. A step with no
    such steps before it keeps its prediction."""
    if len(predicted) != len(measured):
        raise ValueError(
            f"calibrated needs one measured time per prediction, got {len(measured)} "
            f"for {len(predicted)}"
        )
    corrected = []
    for step, guess in enumerate(predicted):
        start = max(skip, step - CALIBRATION_WINDOW)
        ratios = [m / p for p, m in zip(predicted[start:step], measured[start:step]) if p > 0]
        corrected.append(guess * statistics.median(ratios) if ratios else guess)
    return corrected


def shapes_of(lengths: Sequence[int], groups: Sequence[Sequence[int]]) -> list[Shape]:
    """Each group's ``(rows, longest)``: the micro-batch it pads to."""
    return [(len(g), max(lengths[i] for i in g)) for g in groups]


def candidates(
    lengths: Sequence[int], count: int, budget: int | None
) -> dict[str, list[list[int]]]:
    """The formations ``--adaptive`` weighs: ``count`` consecutive groups, ``count`` groups
    of similar lengths, and groups within each multiple of ``budget`` tokens."""
    formed = {"consecutive": fixed_groups(len(lengths), count)}
    longest_first = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    formed["by length"] = [[longest_first[i] for i in g] for g in formed["consecutive"]]
    for factor in BUDGET_FACTORS:
        if budget is not None:
            tokens = max(1, int(budget * factor))
            formed[f"budget {tokens}"] = token_budget_groups(lengths, tokens)
    return formed


@dataclass(frozen=True)
class StepPricer:
    """Simulates a step of the run's schedule family (``family`` on ``ranks`` ranks with
    ``options`` and ``replicas``) on ``fitted`` costs for its stages' ``balance``,
    messages as ``base``."""

    fitted: LengthCosts
    family: str
    ranks: int
    balance: list[int]
    options: Mapping[str, int | bool] = field(default_factory=dict)
    replicas: list[int] | None = None
    base: Costs = field(default_factory=lambda: Costs(forward_s=0.0, backward_s=0.0))

    def step_s(self, shapes: Sequence[Shape], cores: int | None = None) -> float:
        """The simulated step, the ranks sharing ``cores`` cores where they outnumber them
        (``None``: a core each); ValueError where the family cannot play that count."""
        schedule = build(
            self.family, self.ranks, len(shapes), replicas=self.replicas, **self.options
        )
        costs = self.fitted.costs(self.balance, shapes, self.base)
        if cores is None or self.ranks <= cores:
            return simulate(schedule, costs).makespan

        def played(stretched: Costs) -> Timeline:
            return simulate(schedule, stretched)

        stages = len(self.balance)
        return shared_cores_stretch(played, costs, stages, self.ranks, cores)[1].makespan

    def choose(
        self, lengths: Sequence[int], count: int, budget: int | None
    ) -> tuple[str, list[list[int]], float, float]:
        """The fastest candidate formation of a step of documents of ``lengths``: its
        name, groups, predicted step and the predicted step of ``count`` consecutive
        groups (what the run does without ``--adaptive``)."""
        priced = {}
        for name, groups in candidates(lengths, count, budget).items():
            try:
                priced[name] = (self.step_s(shapes_of(lengths, groups)), groups)
            except ValueError:  # a count the family cannot play
                continue
        name = min(priced, key=lambda n: priced[n][0])
        return name, priced[name][1], priced[name][0], priced["consecutive"][0]


def pricer_for(config: TrainConfig) -> StepPricer:
    """The pricer of a resolved ``pipetrain train --data`` run (its costs profiled)."""
    assert config.length_costs is not None
    built = config.built
    replicas = [len(ranks) for ranks in built.stage_ranks]
    return StepPricer(
        config.length_costs,
        built.name,
        config.workers,
        config.pipeline.balance_for(len(config.length_costs.forward), built),
        config.pipeline.schedule_options,
        replicas if max(replicas) > 1 else None,
    )


def agreed(fitted: LengthCosts) -> LengthCosts:
    """Rank 0's fitted costs on every rank (each rank of a torchrun job profiles its own),
    so that ranks reading the same step choose the same formation."""
    import torch.distributed as dist

    values = torch.tensor([fitted.forward, fitted.backward], dtype=torch.float64)
    dist.broadcast(values, src=0)
    forward, backward = values.tolist()
    return LengthCosts([tuple(k) for k in forward], [tuple(k) for k in backward])


def predicted_steps(
    config: TrainConfig, shapes: Sequence[Sequence[Shape]], base: Costs
) -> list[float]:
    """Each step of a corpus run (its micro-batches' shapes) simulated on the profiled
    GPT's costs, messages as ``base`` (measured), the ranks sharing this machine's cores
    where they outnumber them."""
    pricer = replace(pricer_for(config), base=base)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return [pricer.step_s([(rows, length) for rows, length in step], cores) for step in shapes]
