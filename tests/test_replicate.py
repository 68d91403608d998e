"""PipeDream's replication planner finds the brute-force optimum and the papers' plans."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from planning_cases import VGG16_CONVOLUTIONS, resnet_like_profile, vgg16_profile

from pipetrain.planning.replicate import replicate
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
            yield list(zip(bounds, bounds[1:]))


def every_plan(levels: list[Level], level: int, start: int, stop: int) -> Iterator[Nested]:
    """Every pipeline of start..stop-1 at ``level`` on at most ``levels[level].count`` components."""
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
