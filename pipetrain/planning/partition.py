"""Exact minimum-bottleneck partition of a layer sequence into a straight pipeline.

A stage's time is the sum of its layers' compute; a cut between stage ``b`` and ``b + 1``
after layer ``i`` costs ``2 · activation_bytes[i] / bandwidth[b]`` (the activation forward
and its gradient back) and counts as its own term, as in PipeDream:
``bottleneck = max(max stage time, max cut time)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from pipetrain.profiler.costs import Profile

Bandwidth = float | Sequence[float]


def partition(
    compute: Sequence[float],
    stages: int,
    activation_bytes: Sequence[float] | None = None,
    bandwidth: Bandwidth = math.inf,
) -> list[int]:
    """The balance (layers per stage) that minimises the bottleneck; ties favour early stages.

    ``bandwidth`` is bytes/s for every boundary, or one value per boundary (``stages - 1``).
    Among optimal partitions the one whose earlier stages hold the most layers is returned,
    so later stages are the lighter ones: ``partition([1, 2, 3, 4, 5, 6], 2) == [4, 2]``.
    Runs in O(stages · n · w) time with numpy, ``w`` the most layers a stage of an even
    split's bottleneck can hold (at most ``n``).
    """
    costs, cuts = _inputs(compute, stages, activation_bytes, bandwidth)
    n = len(costs)
    prefix = np.concatenate(([0.0], np.cumsum(costs)))
    span = prefix[None, :] - prefix[:, None]  # span[i, e]: compute of layers i..e-1
    empty = np.arange(n + 1)[None, :] <= np.arange(n + 1)[:, None]
    span[empty] = math.inf
    # No stage of an optimal split holds more than the bottleneck of an even one, so each
    # start needs only the stops within it: band[i, j] is span[i, i + 1 + j], or inf.
    ceiling = _even_bottleneck(prefix, cuts, stages)
    width = max(int((span <= ceiling).sum(axis=1).max()), 1)
    stops = np.arange(n + 1)[:, None] + 1 + np.arange(width)[None, :]
    band = np.where(stops <= n, np.take_along_axis(span, np.minimum(stops, n), axis=1), math.inf)
    band[band > ceiling] = math.inf
    # best[k][i]: least bottleneck of layers i.. over the last k stages (exact where it is at
    # most the ceiling, above it elsewhere, which is all that comparing with it needs).
    best = np.full((stages + 1, n + 2), math.inf)
    best[1, :n] = prefix[n] - prefix[:n]
    for k in range(2, stages + 1):
        following = np.append(np.maximum(cuts[stages - k], best[k - 1, : n + 1]), math.inf)
        best[k, : n + 1] = np.maximum(band, following[np.minimum(stops, n + 1)]).min(axis=1)
    target = best[stages, 0]
    balance, start = [], 0
    for index in range(stages - 1):
        k = stages - index
        following = np.maximum(cuts[index], best[k - 1, : n + 1])
        fits = np.flatnonzero(np.maximum(span[start], following) <= target)
        stop = int(fits[-1])
        balance.append(stop - start)
        start = stop
    balance.append(n - start)
    return balance


def _even_bottleneck(prefix: np.ndarray, cuts: list[np.ndarray], stages: int) -> float:
    """The bottleneck of the split at equal shares of the compute, each stage non-empty,
    reckoned as :func:`partition` reckons it."""
    n = len(prefix) - 1
    index = np.arange(stages + 1)
    shares = np.searchsorted(prefix, prefix[n] * index / stages)
    bounds = np.maximum.accumulate(np.clip(shares, index, n - stages + index) - index) + index
    bounds[0], bounds[-1] = 0, n
    worst = float(np.max(prefix[bounds[1:]] - prefix[bounds[:-1]]))
    for boundary in range(stages - 1):
        worst = max(worst, float(cuts[boundary][bounds[boundary + 1]]))
    return worst


def bottleneck(
    compute: Sequence[float],
    balance: Sequence[int],
    activation_bytes: Sequence[float] | None = None,
    bandwidth: Bandwidth = math.inf,
) -> float:
    """The bottleneck of a given balance under the same cost model as :func:`partition`."""
    costs, cuts = _inputs(compute, len(balance), activation_bytes, bandwidth)
    if sum(balance) != len(costs) or min(balance) < 1:
        raise ValueError(
            f"balance {list(balance)} does not split {len(costs)} layers into non-empty stages"
        )
    worst, start = 0.0, 0
    for index, count in enumerate(balance):
        worst = max(worst, float(sum(costs[start : start + count])))
        start += count
        if index < len(balance) - 1:
            worst = max(worst, float(cuts[index][start]))
    return worst


def balance_by_time(profile: Profile, stages: int, bandwidth: Bandwidth = math.inf) -> list[int]:
    """Layers per stage minimising the slowest stage's forward+backward time (and cut transfers)."""
    return partition(
        [layer.compute_s for layer in profile.layers],
        stages,
        [layer.activation_bytes for layer in profile.layers],
        bandwidth,
    )


def _inputs(
    compute: Sequence[float],
    stages: int,
    activation_bytes: Sequence[float] | None,
    bandwidth: Bandwidth,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Checked compute costs and, per boundary, the cut cost at every position 0..n.

    ``cuts[b][e]`` is the time of a cut before layer ``e`` at boundary ``b``; positions 0
    and n are never cut and cost ``inf``.
    """
    costs = np.asarray(compute, dtype=float)
    n = len(costs)
    if n == 0 or costs.ndim != 1 or not np.all(np.isfinite(costs)) or np.any(costs < 0):
        raise ValueError(
            f"compute must be a non-empty list of finite times >= 0, got {list(compute)!r}"
        )
    if isinstance(stages, bool) or not isinstance(stages, int) or not 1 <= stages <= n:
        raise ValueError(
            f"stages must be an integer between 1 and the number of layers ({n}), got {stages!r}"
        )
    sizes = np.zeros(n) if activation_bytes is None else np.asarray(activation_bytes, dtype=float)
    if sizes.shape != (n,) or np.any(sizes < 0):
        raise ValueError(f"activation_bytes must hold {n} sizes >= 0, got {activation_bytes!r}")
    values = np.asarray(bandwidth, dtype=float)
    links = [float(values)] * (stages - 1) if values.ndim == 0 else [float(b) for b in values]
    if len(links) != stages - 1 or any(not b > 0 for b in links):
        raise ValueError(
            f"bandwidth must be one value > 0 or {stages - 1} (one per boundary), got {bandwidth!r}"
        )
    cuts = []
    for link in links:
        cut = np.full(n + 1, math.inf)
        cut[1:n] = 2 * sizes[:-1] / link
        cuts.append(cut)
    return costs, cuts
