"""The straight partition is the exact minimum-bottleneck split (checked by brute force)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.planning.partition import balance_by_time, bottleneck, partition
from pipetrain.profiler import LayerCost, Profile


def brute_force(
    compute: list[int], stages: int, sizes: list[int], links: list[float]
) -> tuple[float, list[int]]:
    """Least bottleneck over every split, and the optimal balance with the most layers up front."""
    n = len(compute)
    best_value, best_balance = math.inf, []
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        value = max(sum(compute[bounds[s] : bounds[s + 1]]) for s in range(stages))
        for boundary, cut in enumerate(cuts):
            value = max(value, 2 * sizes[cut - 1] / links[boundary])
        balance = [bounds[s + 1] - bounds[s] for s in range(stages)]
        if value < best_value or (value == best_value and balance > best_balance):
            best_value, best_balance = value, balance
    return best_value, best_balance


def test_torchgpipe_example() -> None:
    assert partition([1, 2, 3, 4, 5, 6], 2) == [4, 2]


@pytest.mark.parametrize(
    ("compute", "stages", "expected"),
    [
        ([1, 2, 3, 4, 5, 6], 3, [3, 2, 1]),
        ([1, 1, 1, 1], 4, [1, 1, 1, 1]),
        ([7], 1, [1]),
        ([0, 0, 0], 2, [2, 1]),
    ],
)
def test_small_cases(compute: list[int], stages: int, expected: list[int]) -> None:
    assert partition(compute, stages) == expected


def test_a_costly_cut_moves_the_boundary() -> None:
    # Cutting after layer 1 would cost 2 * 100 / 10 = 20; after layer 2 costs 0.
    assert partition([1, 1, 1, 1], 2, [0, 100, 0, 0], 10.0) == [3, 1]
    assert bottleneck([1, 1, 1, 1], [2, 2], [0, 100, 0, 0], 10.0) == 20.0


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_matches_brute_force(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 7))
    stages = data.draw(st.integers(1, n))
    compute = data.draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    sizes = data.draw(st.lists(st.integers(0, 12), min_size=n, max_size=n))
    links = data.draw(
        st.lists(
            st.sampled_from([0.5, 1.0, 2.0, 4.0, math.inf]),
            min_size=stages - 1,
            max_size=stages - 1,
        )
    )
    value, balance = brute_force(compute, stages, sizes, links)
    found = partition(compute, stages, sizes, links)
    assert bottleneck(compute, found, sizes, links) == value
    assert found == balance


@settings(max_examples=50, deadline=None)
@given(
    compute=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=7),
    stages=st.integers(1, 7),
)
def test_float_costs_match_brute_force(compute: list[float], stages: int) -> None:
    stages = min(stages, len(compute))
    value, _ = brute_force(compute, stages, [0] * len(compute), [math.inf] * (stages - 1))  # type: ignore[arg-type]
    found = partition(compute, stages)
    assert bottleneck(compute, found) == pytest.approx(value, rel=1e-12, abs=1e-15)


def every_stop_partition(
    compute: list[float], stages: int, sizes: list[float], links: list[float]
) -> list[int]:
    """The plain dynamic program over every start and stop: ``best[k][i]`` is the least
    bottleneck of layers ``i..`` over the last ``k`` stages; each stage then ends at the last
    stop that keeps the optimum."""
    n = len(compute)
    prefix = np.concatenate(([0.0], np.cumsum(compute)))
    span = prefix[None, :] - prefix[:, None]
    span[np.arange(n + 1)[None, :] <= np.arange(n + 1)[:, None]] = math.inf
    cuts = [
        np.concatenate(([math.inf], 2 * np.asarray(sizes[:-1]) / link, [math.inf]))
        for link in links
    ]
    best = np.full((stages + 1, n + 1), math.inf)
    best[1, :n] = prefix[n] - prefix[:n]
    for k in range(2, stages + 1):
        best[k] = np.maximum(span, np.maximum(cuts[stages - k], best[k - 1])[None, :]).min(axis=1)
    balance, start = [], 0
    for index in range(stages - 1):
        following = np.maximum(cuts[index], best[stages - index - 1])
        stop = int(np.flatnonzero(np.maximum(span[start], following) <= best[stages, 0])[-1])
        balance.append(stop - start)
        start = stop
    return [*balance, n - start]


@pytest.mark.parametrize("seed", range(40))
def test_long_models_match_the_plain_dynamic_program(seed: int) -> None:
    """Up to 80 layers, where only stops near an even split's bottleneck are examined."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 80))
    stages = int(rng.integers(1, n + 1))
    compute = np.round(rng.uniform(0, 10, n), int(rng.integers(0, 3)))
    compute[rng.random(n) < 0.2] = 0.0
    sizes = np.round(rng.uniform(0, 10, n)) * (rng.random(n) < 0.5)
    links = [float(b) for b in rng.choice([0.5, 4.0, 100.0, math.inf], stages - 1)]
    expected = every_stop_partition(compute.tolist(), stages, sizes.tolist(), links)
    assert partition(compute.tolist(), stages, sizes.tolist(), links) == expected


def test_balance_by_time_uses_forward_plus_backward() -> None:
    profile = Profile([LayerCost(forward_s=f, backward_s=2 * f) for f in [1, 2, 3, 4, 5, 6]])
    assert balance_by_time(profile, 2) == [4, 2]


def test_errors_name_the_bad_value() -> None:
    with pytest.raises(ValueError, match="between 1 and the number of layers"):
        partition([1, 2], 3)
    with pytest.raises(ValueError, match="compute must be"):
        partition([1, -2], 1)
    with pytest.raises(ValueError, match="one per boundary"):
        partition([1, 2, 3], 3, [1, 1, 1], [1.0])
    with pytest.raises(ValueError, match="activation_bytes"):
        partition([1, 2, 3], 2, [1, 1])
    with pytest.raises(ValueError, match="does not split"):
        bottleneck([1, 2, 3], [1, 1])
