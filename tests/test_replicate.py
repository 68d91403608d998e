"""PipeDream's replication planner finds the brute-force optimum and the papers' plans."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from planning_cases import VGG16_CONVOLUTIONS, resnet_like_profile, vgg16_profile

from pipetrain.planning.replicate import ReplicatedStage, replicate
from pipetrain.planning.topology import Level, Topology
from pipetrain.profiler import Profile

# A nested plan: stages (start, stop, replicas, pipeline inside one component of the level below).
Nested = list[tuple[int, int, int, list]]


def splits(start: int, stop: int) -> Iterator[list[tuple[int, int]]]:
    """Every way to cut layers start..stop-1 into contiguous non-empty stages."""
    inner = range(start + 1, stop)
    for count in range(len(inner) + 1):
        for cuts in itertools.combinations(inner, count):
            bounds = (start, *cuts, stop)
            yield list(itertools.pairwise(bounds))


def every_plan(levels: list[Level], level: int, start: int, stop: int) -> Iterator[Nested]:
    """Every pipeline of start..stop-1 at ``level`` on at most ``levels[level].count``
    components."""
    for stages in splits(start, stop):
        yield from assignments(levels, level, stages, levels[level].count)


def assignments(
    levels: list[Level], level: int, stages: list[tuple[int, int]], budget: int
) -> Iterator[Nested]:
    """Every replica count (total at most ``budget``) and inner pipeline for ``stages``."""
    if not stages:
        yield []
        return
    (start, stop), rest = stages[0], stages[1:]
    inners = [[]] if level == 0 else list(every_plan(levels, level - 1, start, stop))
    for replicas in range(1, budget - len(rest) + 1):
        for inner in inners:
            for tail in assignments(levels, level, rest, budget - replicas):
                yield [(start, stop, replicas, inner), *tail]


def cost(
    levels: list[Level],
    level: int,
    plan: Nested,
    share: float,
    compute: list[float],
    weights: list[float],
    activations: list[float],
    sync: str,
) -> float:
    """The bottleneck of a nested plan, written out from the cost model's definition."""
    bandwidth = levels[level].bandwidth
    terms = []
    for index, (start, stop, replicas, inner) in enumerate(plan):
        part = share / replicas
        if level == 0:
            work = part * sum(compute[start:stop])
        else:
            work = cost(levels, level - 1, inner, part, compute, weights, activations, sync)
        allreduce = 2 * (replicas - 1) / replicas * sum(weights[start:stop]) / bandwidth
        terms += [work, allreduce * (1.0 if sync == "step" else share / replicas)]
        if index + 1 < len(plan):
            terms.append(share * 2 * activations[stop - 1] / bandwidth)
    return max(terms)


def brute_force(
    compute: list[float],
    weights: list[float],
    activations: list[float],
    topology: Topology,
    sync: str,
) -> float:
    """The least bottleneck over every nested plan."""
    levels = list(topology.levels)
    top = len(levels) - 1
    return min(
        cost(levels, top, plan, 1.0, compute, weights, activations, sync)
        for plan in every_plan(levels, top, 0, len(compute))
    )


def flat_brute_force(
    compute: list[float],
    weights: list[float],
    activations: list[float],
    workers: int,
    bandwidth: float,
    sync: str,
) -> float:
    """Cut points × replica counts (total at most ``workers``), PipeDream's flat objective."""
    best = math.inf
    for stages in splits(0, len(compute)):
        for replicas in itertools.product(range(1, workers + 1), repeat=len(stages)):
            if sum(replicas) > workers:
                continue
            terms = []
            for (start, stop), r in zip(stages, replicas):
                allreduce = 2 * (r - 1) / r * sum(weights[start:stop]) / bandwidth
                c = sum(compute[start:stop])
                terms.append(max(c / r, allreduce) if sync == "step" else max(c, allreduce) / r)
            terms += [2 * activations[stop - 1] / bandwidth for _, stop in stages[:-1]]
            best = min(best, max(terms))
    return best


values = st.one_of(st.just(0.0), st.floats(0.01, 10.0))


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    workers=st.integers(1, 4),
    bandwidth=st.sampled_from([0.5, 1.0, 4.0, math.inf]),
    sync=st.sampled_from(["step", "replica"]),
)
def test_flat_planner_matches_brute_force(
    data: st.DataObject, workers: int, bandwidth: float, sync: str
) -> None:
    n = data.draw(st.integers(1, 5))
    compute, weights, activations = (
        data.draw(st.lists(values, min_size=n, max_size=n)) for _ in range(3)
    )
    result = replicate(compute, weights, activations, Topology.flat(workers, bandwidth), sync)
    expected = flat_brute_force(compute, weights, activations, workers, bandwidth, sync)
    assert result.bottleneck == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert result.workers <= workers
    assert [s.start for s in result.stages] == [0] + [s.stop for s in result.stages[:-1]]
    assert result.stages[-1].stop == n
    nested = [(s.start, s.stop, s.replicas, []) for s in result.stages]
    achieved = cost(
        [Level(workers, bandwidth)], 0, nested, 1.0, compute, weights, activations, sync
    )
    assert achieved == pytest.approx(result.bottleneck, rel=1e-12, abs=1e-15)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    counts=st.lists(st.integers(1, 3), min_size=2, max_size=2),
    bandwidths=st.lists(st.sampled_from([0.5, 2.0, 8.0]), min_size=2, max_size=2),
    sync=st.sampled_from(["step", "replica"]),
)
def test_hierarchical_planner_matches_brute_force(
    data: st.DataObject, counts: list[int], bandwidths: list[float], sync: str
) -> None:
    n = data.draw(st.integers(1, 4))
    compute, weights, activations = (
        data.draw(st.lists(values, min_size=n, max_size=n)) for _ in range(3)
    )
    topology = Topology([Level(c, b) for c, b in zip(counts, bandwidths)])
    result = replicate(compute, weights, activations, topology, sync)
    expected = brute_force(compute, weights, activations, topology, sync)
    assert result.bottleneck == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert result.workers <= topology.workers


def columns(
    profile: Profile, microbatches: int = 1
) -> tuple[list[float], list[float], list[float]]:
    """Compute and activations for ``microbatches`` micro-batches, and weights, per layer."""
    layers = profile.layers
    return (
        [microbatches * layer.compute_s for layer in layers],
        [layer.parameter_bytes for layer in layers],
        [microbatches * layer.activation_bytes for layer in layers],
    )


def test_vgg16_replicates_the_convolutions_and_not_the_classifier() -> None:
    """PipeDream's formula on 4 servers × 4 GPUs over 10 Gbit/s (its "15-1" setting)."""
    result = replicate(
        *columns(vgg16_profile()), Topology.parse("4x16GB/s,4x10Gbit/s"), sync="replica"
    )
    convolutions = [s for s in result.stages if s.start < VGG16_CONVOLUTIONS]
    classifier = [s for s in result.stages if s.stop > VGG16_CONVOLUTIONS]
    assert min(s.replicas for s in convolutions) >= 8
    assert max(s.replicas for s in classifier) <= 4
    compute, weights, _ = columns(vgg16_profile())
    data_parallel = max(sum(compute), 2 * 15 / 16 * sum(weights) / 1.25e9) / 16
    assert result.bottleneck < data_parallel / 1.5


@pytest.mark.parametrize("sync", ["step", "replica"])
def test_small_weights_on_a_fast_network_give_data_parallelism(sync: str) -> None:
    result = replicate(*columns(resnet_like_profile()), Topology.parse("8x300GB/s"), sync=sync)
    assert [(s.start, s.stop, s.replicas) for s in result.stages] == [(0, 50, 8)]


def test_errors() -> None:
    with pytest.raises(ValueError, match="sync must be one of"):
        replicate([1.0], [1.0], [1.0], Topology.flat(2), sync="sometimes")
    with pytest.raises(ValueError, match="weight_bytes must hold 2"):
        replicate([1.0, 2.0], [1.0], [1.0, 1.0], Topology.flat(2))
    with pytest.raises(ValueError, match="compute must hold"):
        replicate([1.0, -2.0], [1.0, 1.0], [1.0, 1.0], Topology.flat(2))


class Reference:
    """The planner's definition, computed the plain way: for a bottleneck, ``reach[b - 1][s]``
    is the furthest stop of a pipeline from every start ``s`` on at most ``b`` components,
    level by level; bisection on the bottleneck to a relative 1e-12 from
    ``[0, total compute]``; then the plan built at the bisection's upper end, preferring one
    stage (fewest replicas), then the first stage with the fewest replicas and most layers."""

    def __init__(self, compute: list[float], weights: list[float], activations: list[float],
                 topology: Topology, sync: str) -> None:  # fmt: skip
        self.n, self.levels, self.sync = len(compute), topology.levels, sync
        self.compute = np.concatenate(([0.0], np.cumsum(compute)))
        self.weights = np.concatenate(([0.0], np.cumsum(weights)))
        self.cuts = np.concatenate(([0.0], 2 * np.asarray(activations[:-1], dtype=float), [0.0]))
        self.starts = np.arange(self.n + 1)

    def stage(self, level: int, theta: float, share: float) -> np.ndarray:
        count, bandwidth = self.levels[level].count, self.levels[level].bandwidth
        rows = []
        for r in range(1, count + 1):
            if level == 0:
                reach = np.searchsorted(self.compute, self.compute + theta * r / share, "right") - 1
            else:
                reach = self.pipeline(level - 1, theta, share / r)[-1]
            per_byte = 2 * (r - 1) / (r * bandwidth) * (1.0 if self.sync == "step" else share / r)
            if per_byte > 0:
                limit = self.weights + theta / per_byte
                reach = np.minimum(reach, np.searchsorted(self.weights, limit, "right") - 1)
            rows.append(np.maximum(reach, self.starts))
        return np.array(rows)

    def last_cut(self, level: int, theta: float, share: float) -> np.ndarray:
        inner = (self.starts > 0) & (self.starts < self.n)
        allowed = inner & (share * self.cuts / self.levels[level].bandwidth <= theta)
        return np.maximum.accumulate(np.where(allowed, self.starts, -1))

    def pipeline(self, level: int, theta: float, share: float) -> np.ndarray:
        single = np.maximum.accumulate(self.stage(level, theta, share), axis=0)
        last = self.last_cut(level, theta, share)
        reach = single.copy()
        for b in range(2, len(single) + 1):
            for first in range(1, b):
                cut = last[single[first - 1]]
                further = np.where(cut > self.starts, reach[b - first - 1][np.maximum(cut, 0)], 0)
                reach[b - 1] = np.maximum(reach[b - 1], further)
        return reach

    def build(self, level: int, theta: float, share: float, start: int, stop: int,
              budget: int) -> list[tuple[int, int, int, list]]:  # fmt: skip
        stage = self.stage(level, theta, share)
        for r in range(1, budget + 1):
            if stage[r - 1][start] >= stop:
                return [self.node(level, theta, share, start, stop, r)]
        single = np.maximum.accumulate(stage, axis=0)
        reach, last = self.pipeline(level, theta, share), self.last_cut(level, theta, share)
        for first in range(1, budget):
            cut = int(last[min(int(single[first - 1][start]), stop - 1)])
            if cut > start and reach[budget - first - 1][cut] >= stop:
                r = next(r for r in range(1, first + 1) if stage[r - 1][start] >= cut)
                head = self.node(level, theta, share, start, cut, r)
                return [head, *self.build(level, theta, share, cut, stop, budget - r)]
        raise AssertionError("no pipeline")

    def node(self, level: int, theta: float, share: float, start: int, stop: int,
             r: int) -> tuple[int, int, int, list]:  # fmt: skip
        count = self.levels[level - 1].count if level else 0
        inner = self.build(level - 1, theta, share / r, start, stop, count) if level else []
        return (start, stop, r, inner)

    def plan(self) -> list[ReplicatedStage]:
        top = len(self.levels) - 1

        def feasible(theta: float) -> bool:
            return bool(self.pipeline(top, theta, 1.0)[-1][0] >= self.n)

        low, high = 0.0, float(self.compute[-1])
        if feasible(low):
            high = low
        while high - low > 1e-12 * high:
            middle = (low + high) / 2
            low, high = (low, middle) if feasible(middle) else (middle, high)
        nodes = self.build(top, high, 1.0, 0, self.n, self.levels[top].count)
        return flatten(nodes, 1)


def flatten(nodes: Nested, multiplier: int) -> list[ReplicatedStage]:
    """A nested plan's stages in pipeline order, replicas multiplied down the levels."""
    stages = []
    for start, stop, replicas, inner in nodes:
        if inner:
            stages += flatten(inner, multiplier * replicas)
        else:
            stages.append(ReplicatedStage(start, stop, multiplier * replicas))
    return stages


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    counts=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    bandwidths=st.lists(st.sampled_from([0.5, 2.0, 30.0, math.inf]), min_size=3, max_size=3),
    sync=st.sampled_from(["step", "replica"]),
)
def test_the_plan_is_the_reference_plan(
    data: st.DataObject, counts: list[int], bandwidths: list[float], sync: str
) -> None:
    """The same stages, replicas and bottleneck, to the last bit, as the plain computation."""
    n = data.draw(st.integers(1, 12))
    compute, weights, activations = (
        data.draw(st.lists(values, min_size=n, max_size=n)) for _ in range(3)
    )
    topology = Topology([Level(c, b) for c, b in zip(counts, bandwidths)])
    result = replicate(compute, weights, activations, topology, sync)
    assert list(result.stages) == Reference(compute, weights, activations, topology, sync).plan()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("sync", ["step", "replica"])
def test_many_workers_on_one_level_give_the_reference_plan(seed: int, sync: str) -> None:
    """More workers than twice the layers: the planner counts workers per suffix instead."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 8))
    compute, weights, activations = (
        [float(v) for v in np.round(rng.uniform(0, 10, n), int(rng.integers(0, 3)))]
        for _ in range(3)
    )
    topology = Topology.flat(int(rng.integers(2 * n + 1, 40)), float(rng.choice([0.5, 4.0, 1e9])))
    result = replicate(compute, weights, activations, topology, sync)
    assert list(result.stages) == Reference(compute, weights, activations, topology, sync).plan()


def test_thousands_of_workers_plan_in_a_moment() -> None:
    """500 layers on 4096 workers joined by infinitely fast links: one data-parallel stage."""
    compute = [1e-3 * (1 + index % 7) for index in range(500)]
    result = replicate(compute, [1e6] * 500, [1e5] * 500, Topology.flat(4096))
    assert [(s.start, s.stop, s.replicas) for s in result.stages] == [(0, 500, 4096)]
    assert result.bottleneck == pytest.approx(sum(compute) / 4096, rel=1e-3)
