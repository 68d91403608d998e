"""Replicated pipelines of every depth: for each stage count, the least-bottleneck layout.

PipeDream's planner (:mod:`pipetrain.planning.replicate`) returns the one pipeline its cost
model ranks first, and that model leaves out what the simulator charges: bubbles that grow
with the stage count, each message's latency, the cores that workers share. Plans its model
ranks a few percent apart can run far apart, so the planner also simulates, for every stage
count ``d``, the best pipeline of exactly ``d`` stages on every worker under the same model
(one level of links, the all-reduce once per step): a replicated layout of each depth from
data parallelism (``d = 1``) to a straight pipeline (``d = workers``), and lets the
simulation choose.

``A(d, j, m)``, the least bottleneck of layers ``0..j-1`` in ``d`` stages on exactly ``m``
workers, is ``min over i, r of max{A(d - 1, i, m - r), 2·a_(i-1)/B, T(i→j, r)}`` with
``T(i→j, r) = max{C(i→j)/r, 2 (r - 1)/r · W(i→j)/B}``: ``O(workers³ · layers²)`` work.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipetrain.planning.replicate import ReplicatedStage

MAX_WORK = 50_000_000
"""The largest ``workers³ · layers²`` searched; larger problems keep PipeDream's one answer."""


def by_depth(
    compute: Sequence[float],
    weight_bytes: Sequence[float],
    activation_bytes: Sequence[float],
    workers: int,
    bandwidth: float,
) -> list[tuple[ReplicatedStage, ...]]:
    """For each stage count from 1 to ``min(workers, layers)``, the stages (in pipeline
    order, their replicas summing to ``workers``) with the least bottleneck under
    PipeDream's cost model on links of ``bandwidth`` bytes/s, followed, where fewer workers
    reach as small a bottleneck (a replica's all-reduce can cost more than its share of the
    compute saves), by the least-bottleneck stages on the fewest workers; empty where the
    search would cost more than :data:`MAX_WORK`.

    Arguments as :func:`pipetrain.planning.replicate.replicate`'s: per layer, forward +
    backward compute for one step, weight bytes and output bytes.
    """
    n = len(compute)
    if workers < 1 or n == 0 or workers**3 * n**2 > MAX_WORK:
        return []
    compute_sums = np.concatenate(([0.0], np.cumsum(compute)))
    weight_sums = np.concatenate(([0.0], np.cumsum(weight_bytes)))
    # a cut before layer i carries its input forward and the gradient back
    sent = 2 * np.asarray(activation_bytes[:-1], dtype=float) / bandwidth
    cut = np.concatenate(([0.0], sent, [0.0]))
    span_compute = compute_sums[None, :] - compute_sums[:, None]  # [i, j]: layers i..j-1
    span_weights = weight_sums[None, :] - weight_sums[:, None]
    later = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)  # a stage holds a layer or more

    def stage_time(replicas: int) -> np.ndarray:
        """``T(i→j, replicas)`` for every ``i < j`` (infinite elsewhere)."""
        sync = 2 * (replicas - 1) / replicas * span_weights / bandwidth
        return np.where(later, np.maximum(span_compute / replicas, sync), np.inf)

    times = [stage_time(r) for r in range(1, workers + 1)]
    # best[m][j]: the least bottleneck of layers 0..j-1 on exactly m workers at this depth
    best = np.full((workers + 1, n + 1), np.inf)
    for m in range(1, workers + 1):
        best[m] = times[m - 1][0]
    choices: list[np.ndarray] = []  # per depth >= 2: [m, j] -> (i, r) of the last stage
    layouts = _both(best, choices, n, workers)
    for depth in range(2, min(workers, n) + 1):
        following = np.full_like(best, np.inf)
        choice = np.zeros((workers + 1, n + 1, 2), dtype=np.int64)
        for m in range(depth, workers + 1):
            for r in range(1, m - depth + 2):
                # [i, j]: the first i layers at depth - 1 on m - r workers, then i..j-1 on r
                options = np.maximum(np.maximum(best[m - r], cut)[:, None], times[r - 1])
                starts = np.argmin(options, axis=0)
                values = options[starts, np.arange(n + 1)]
                better = values < following[m]
                following[m] = np.where(better, values, following[m])
                choice[m, better] = np.stack([starts[better], np.full(better.sum(), r)], axis=1)
        best = following
        choices.append(choice)
        layouts += _both(best, choices, n, workers)
    return layouts


def _both(
    best: np.ndarray, choices: list[np.ndarray], n: int, workers: int
) -> list[tuple[ReplicatedStage, ...]]:
    """At the depth ``choices`` has reached: the layout on every worker, and the one on the
    fewest workers among those with the least bottleneck if that leaves some idle."""
    every = _stages(choices, len(choices), n, workers)
    fewest = int(np.argmin(best[:, n]))  # the first least: the fewest workers
    if fewest == workers or not np.isfinite(best[fewest, n]):
        return [every]
    return [every, _stages(choices, len(choices), n, fewest)]


def _stages(
    choices: list[np.ndarray], depth_index: int, stop: int, workers: int
) -> tuple[ReplicatedStage, ...]:
    """The stages that ``choices`` record for depth ``depth_index + 1``, layers
    ``0..stop-1`` on ``workers`` workers, in pipeline order."""
    stages: list[ReplicatedStage] = []
    for index in range(depth_index - 1, -1, -1):
        start, replicas = (int(value) for value in choices[index][workers, stop])
        stages.append(ReplicatedStage(start, stop, replicas))
        stop, workers = start, workers - replicas
    stages.append(ReplicatedStage(0, stop, workers))
    return tuple(reversed(stages))
