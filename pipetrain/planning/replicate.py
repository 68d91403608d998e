"""PipeDream's planner: a pipeline of replicated stages over a hierarchical topology.

Cost model (PipeDream, SOSP'19 §3.1; ANCHORS.md). Layers ``i..j-1`` have compute ``C``
(forward + backward for one unit of work, e.g. one mini-batch), weights ``W`` bytes, and
layer ``i`` sends ``a_i`` activation bytes to layer ``i + 1``. At topology level ``k``
(bandwidth ``B_k``) a stage over ``r`` components of level ``k - 1`` is charged

- compute: the best pipeline of the same layers inside one component, on its ``1/r``
  share of the work (plain compute ``C/r`` at level 0: single workers);
- weight synchronisation: a ring all-reduce, ``S = 2 (r - 1) / r · W / B_k`` (each
  worker sends and receives ``(r - 1)/r · W`` twice), overlapped with compute: the
  stage time is the larger of the two;
- a cut between two stages: ``2 · a_i / B_k`` for the work share that crosses it
  (activation forward, gradient back), a bottleneck term of its own.

The pipeline's time is its slowest term (its bottleneck), and the plan minimises it:
``A(j, m) = min over i < j, m' < m of max{A(i, m - m'), 2·a_i/B, T(i→j, m')}``, solved level
by level from the lowest up, the best pipeline inside one component serving as the compute
of a component one level up (PipeDream's hierarchical form).

Two synchronisation regimes (``sync``):

- ``"step"`` (synchronous schedules: GPipe, 1F1B, ...): the replicas split one step's work
  and all-reduce once per step, so ``T(r) = max(C/r, S)``.
- ``"replica"`` (PipeDream's asynchronous form): each replica all-reduces after each of its
  own mini-batches, so ``T(r) = max(C, S) / r``, the paper's formula.

Every pipeline uses at most the workers it is given. The optimum is found by bisection on
the bottleneck: for a candidate bottleneck ``θ`` a dynamic program computes, for every
start layer and worker budget, the furthest layer a feasible pipeline can reach (feasibility
is monotone in both), in O(n · m²) numpy operations per level.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipetrain.planning.topology import Topology

SYNC_MODES = ("step", "replica")
_RELATIVE_TOLERANCE = 1e-12


@dataclass(frozen=True)
class ReplicatedStage:
    """Layers ``start..stop-1`` run on ``replicas`` workers (data parallel among them)."""

    start: int
    stop: int
    replicas: int


@dataclass(frozen=True)
class Replication:
    """The planner's answer: stages in pipeline order and the bottleneck they achieve."""

    stages: tuple[ReplicatedStage, ...]
    bottleneck: float

    @property
    def workers(self) -> int:
        """Workers the plan uses (at most the topology's)."""
        return sum(stage.replicas for stage in self.stages)


@dataclass(frozen=True)
class _Node:
    """A stage at some topology level; ``inner`` is its pipeline inside one component."""

    start: int
    stop: int
    replicas: int
    inner: tuple[_Node, ...]


class _Model:
    """Prefix sums and per-level feasibility tests for one problem instance."""

    def __init__(
        self,
        compute: np.ndarray,
        weight_bytes: np.ndarray,
        activation_bytes: np.ndarray,
        topology: Topology,
        sync: str,
    ) -> None:
        """Prefix sums of compute and weights; the bytes crossing a cut before each layer."""
        self.n = len(compute)
        self.compute = np.concatenate(([0.0], np.cumsum(compute)))
        self.weights = np.concatenate(([0.0], np.cumsum(weight_bytes)))
        self.cut_bytes = np.concatenate(
            ([0.0], 2 * np.asarray(activation_bytes[:-1], dtype=float), [0.0])
        )
        self.inner_positions = (np.arange(self.n + 1) > 0) & (np.arange(self.n + 1) < self.n)
        self.levels = topology.levels
        self.sync = sync
        self.starts = np.arange(self.n + 1)

    def sync_scale(self, share: float, replicas: int) -> float:
        """Multiplier of the all-reduce time at a stage doing ``share`` of the work."""
        return 1.0 if self.sync == "step" else share / replicas

    def stage_reach(self, level: int, theta: float, share: float) -> np.ndarray:
        """``reach[r - 1][s]``: furthest stop of a one-stage range from ``s`` on ``r`` components."""
        count, bandwidth = self.levels[level].count, self.levels[level].bandwidth
        reaches = np.empty((count, self.n + 1), dtype=np.int64)
        for replicas in range(1, count + 1):
            if level == 0:
                limit = self.compute + theta * replicas / share
                reach = np.searchsorted(self.compute, limit, side="right") - 1
            else:
                reach = self.pipeline_reach(level - 1, theta, share / replicas)[-1]
            if replicas > 1:
                sync_per_byte = (
                    2 * (replicas - 1) / (replicas * bandwidth) * self.sync_scale(share, replicas)
                )
                if sync_per_byte > 0:
                    limit = self.weights + theta / sync_per_byte
                    reach = np.minimum(
                        reach, np.searchsorted(self.weights, limit, side="right") - 1
                    )
            reaches[replicas - 1] = np.maximum(reach, self.starts)
        return reaches

    def last_cut(self, level: int, theta: float, share: float) -> np.ndarray:
        """``last[x]``: the largest allowed cut position ``c <= x`` (``-1`` if none)."""
        allowed = self.inner_positions & (
            share * self.cut_bytes / self.levels[level].bandwidth <= theta
        )
        positions = np.where(allowed, self.starts, -1)
        return np.maximum.accumulate(positions)

    def pipeline_reach(self, level: int, theta: float, share: float) -> np.ndarray:
        """``reach[b - 1][s]``: furthest stop of a feasible pipeline from ``s`` on at most ``b`` components."""
        single = np.maximum.accumulate(self.stage_reach(level, theta, share), axis=0)
        # cut[f - 1][s]: where a first stage from s on at most f components ends (-1: nowhere).
        cut = self.last_cut(level, theta, share)[single]
        usable = cut > self.starts
        cut = np.maximum(cut, 0)
        reach = np.empty_like(single)
        reach[0] = single[0]
        for budget in range(2, len(single) + 1):
            rest = np.arange(budget - 2, -1, -1)[:, None]  # budget left after the first stage
            further = np.where(usable[: budget - 1], reach[rest, cut[: budget - 1]], self.starts)
            reach[budget - 1] = np.maximum(single[budget - 1], further.max(axis=0))
        return reach

    def feasible(self, theta: float) -> bool:
        """Whether some plan on the whole topology has bottleneck <= ``theta``."""
        return bool(self.pipeline_reach(len(self.levels) - 1, theta, 1.0)[-1][0] >= self.n)

    def build(
        self, level: int, theta: float, share: float, start: int, stop: int, budget: int
    ) -> tuple[_Node, ...]:
        """A pipeline of layers ``start..stop-1`` on at most ``budget`` components within ``theta``.

        Prefers one stage (fewest replicas that fit), then the first stage with the fewest
        replicas and as many layers as possible.
        """
        stage = self.stage_reach(level, theta, share)
        for replicas in range(1, budget + 1):
            if stage[replicas - 1][start] >= stop:
                return (self._node(level, theta, share, start, stop, replicas),)
        single = np.maximum.accumulate(stage, axis=0)
        reach = self.pipeline_reach(level, theta, share)
        cuts = self.last_cut(level, theta, share)
        for first in range(1, budget):
            cut = int(cuts[min(int(single[first - 1][start]), stop - 1)])
            if cut > start and reach[budget - first - 1][cut] >= stop:
                replicas = next(r for r in range(1, first + 1) if stage[r - 1][start] >= cut)
                head = self._node(level, theta, share, start, cut, replicas)
                return (head,) + self.build(level, theta, share, cut, stop, budget - replicas)
        raise AssertionError(f"no pipeline of layers {start}..{stop - 1} within {theta}")

    def _node(
        self, level: int, theta: float, share: float, start: int, stop: int, replicas: int
    ) -> _Node:
        """One stage and, above level 0, its pipeline inside one component."""
        inner: tuple[_Node, ...] = ()
        if level > 0:
            inner = self.build(
                level - 1, theta, share / replicas, start, stop, self.levels[level - 1].count
            )
        return _Node(start, stop, replicas, inner)

    def time(self, level: int, nodes: Sequence[_Node], share: float) -> float:
        """Exact bottleneck of a pipeline at ``level`` doing ``share`` of the work."""
        bandwidth = self.levels[level].bandwidth
        worst = 0.0
        for index, node in enumerate(nodes):
            part = share / node.replicas
            if level == 0:
                work = part * (self.compute[node.stop] - self.compute[node.start])
            else:
                work = self.time(level - 1, node.inner, part)
            weights = self.weights[node.stop] - self.weights[node.start]
            sync = (
                2
                * (node.replicas - 1)
                / node.replicas
                * weights
                / bandwidth
                * self.sync_scale(share, node.replicas)
            )
            worst = max(worst, work, sync)
            if index < len(nodes) - 1:
                worst = max(worst, share * self.cut_bytes[node.stop] / bandwidth)
        return float(worst)


def replicate(
    compute: Sequence[float],
    weight_bytes: Sequence[float],
    activation_bytes: Sequence[float],
    topology: Topology,
    sync: str = "step",
) -> Replication:
    """The pipeline of replicated stages with the least bottleneck on ``topology``.

    ``compute[i]`` is layer ``i``'s forward + backward time for one unit of work,
    ``weight_bytes[i]`` its weights, ``activation_bytes[i]`` its output per unit of work.
    Returns flat stages (a stage replicated ``r`` ways inside each of ``r'`` components
    has ``r · r'`` replicas) and the exact bottleneck of the hierarchical plan.
    """
    if sync not in SYNC_MODES:
        raise ValueError(f"sync must be one of {SYNC_MODES}, got {sync!r}")
    arrays = [
        np.asarray(values, dtype=float) for values in (compute, weight_bytes, activation_bytes)
    ]
    n = len(arrays[0])
    for label, values in zip(("compute", "weight_bytes", "activation_bytes"), arrays):
        if values.shape != (n,) or n == 0 or not np.all(np.isfinite(values)) or np.any(values < 0):
            raise ValueError(
                f"{label} must hold {max(n, 1)} finite values >= 0 (one per layer), got {values.tolist()}"
            )
    model = _Model(*arrays, topology, sync)
    top = len(topology.levels) - 1
    low, high = 0.0, float(model.compute[-1])
    if model.feasible(low):
        high = low
    while high - low > _RELATIVE_TOLERANCE * high:
        middle = (low + high) / 2
        if model.feasible(middle):
            high = middle
        else:
            low = middle
    nodes = model.build(top, high, 1.0, 0, n, topology.levels[top].count)
    return Replication(tuple(_flatten(nodes, 1)), model.time(top, nodes, 1.0))


def _flatten(nodes: Sequence[_Node], multiplier: int) -> list[ReplicatedStage]:
    """Stages of a nested plan in pipeline order, replicas multiplied down the levels."""
    stages = []
    for node in nodes:
        if node.inner:
            stages += _flatten(node.inner, multiplier * node.replicas)
        else:
            stages.append(ReplicatedStage(node.start, node.stop, multiplier * node.replicas))
    return stages
