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
the bottleneck ``θ``, each step asking :mod:`pipetrain.planning.reach` whether some plan
fits within ``θ``; one batched test answers the next few steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipetrain.planning.reach import Reach
from pipetrain.planning.topology import Topology

SYNC_MODES = ("step", "replica")
_RELATIVE_TOLERANCE = 1e-12
_BATCH_DEPTH = 4  # bisection steps whose midpoints one batched feasibility test answers


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
                f"{label} must hold {max(n, 1)} finite values >= 0 (one per layer), "
                f"got {values.tolist()}"
            )
    reach = Reach(arrays[0], arrays[1], arrays[2], topology.levels, sync)
    top = len(topology.levels) - 1
    reach.use([_least_bottleneck(reach)])
    nodes = _build(reach, top, 0, 0, n, topology.levels[top].count)
    return Replication(tuple(_flatten(nodes, 1)), _time(reach, top, nodes, 1.0))


def _least_bottleneck(reach: Reach) -> float:
    """The least feasible bottleneck, to a relative 1e-12, by bisection from
    ``[0, total compute]``.

    Feasibility is monotone in the bottleneck, so every test answers the midpoints on its far
    side. Each round tests together the unanswered midpoints of the next
    :data:`_BATCH_DEPTH` steps; the first also tests two likely bounds (:func:`_guesses`)
    and takes its midpoints from where the bisection goes if they hold.
    """
    depth = 1 if reach.many_workers else _BATCH_DEPTH
    low, high = 0.0, float(reach.compute[-1])
    guesses = _guesses(reach)
    below, above = guesses or (-math.inf, math.inf)
    tests = [low, *guesses, *_midpoints(low, high, above, below, depth)]
    passes, fails = math.inf, -math.inf  # least bottleneck known to pass, greatest to fail
    while True:
        unknown = [theta for theta in tests if fails < theta < passes]
        for theta, ok in zip(unknown, reach.feasible(unknown) if unknown else []):
            if ok:
                passes = min(passes, theta)
            else:
                fails = max(fails, theta)
        if low >= passes:
            return low
        low, high = _walk(low, high, passes, fails)
        if not high - low > _RELATIVE_TOLERANCE * high:
            return high
        tests = _midpoints(low, high, passes, fails, depth)


def _walk(low: float, high: float, passes: float, fails: float) -> tuple[float, float]:
    """Bisection steps from ``[low, high]`` while the answers are known: bottlenecks from
    ``passes`` up pass, those up to ``fails`` fail."""
    while high - low > _RELATIVE_TOLERANCE * high:
        middle = (low + high) / 2
        if fails < middle < passes:
            break
        low, high = (low, middle) if middle >= passes else (middle, high)
    return low, high


def _midpoints(low: float, high: float, passes: float, fails: float, depth: int) -> list[float]:
    """The midpoints the ``depth`` bisection steps after the known ones may test."""
    middles, ranges = [], [_walk(low, high, passes, fails)]
    for _ in range(depth):
        following = []
        for start, stop in ranges:
            if stop - start > _RELATIVE_TOLERANCE * stop:
                middle = (start + stop) / 2
                middles.append(middle)
                following += [(start, middle), (middle, stop)]
        ranges = following
    return middles


def _guesses(reach: Reach) -> list[float]:
    """Two bottlenecks worth testing first, the first likely to fail and the second to pass.

    The compute spread evenly over every worker bounds the bottleneck from below, and plans
    that compute more than they communicate come within a quarter of it. With many workers on
    one level, where tests cost more: the least float bottleneck that one stage on all of them
    meets (found by bisection on the floats' bit patterns) and the float below it, which
    answer every step where data parallelism is the best plan.
    """
    workers = math.prod(level.count for level in reach.levels)
    if not reach.many_workers:
        even = float(reach.compute[-1]) / workers
        return [even, 1.25 * even] if even > 0 else []
    only = np.zeros(1, dtype=np.int64)

    def fits(bits: int) -> bool:
        reach.use([float(np.int64(bits).view(np.float64))])
        limits = reach.limits(0, only, only, np.array(workers))
        return bool(reach.stage_reach(0, only, only, np.array(workers), 0, limits)[0] >= reach.n)

    low, high = 0, int(np.float64(np.inf).view(np.int64))
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    theta = float(np.int64(high).view(np.float64))
    below = float(np.nextafter(theta, 0.0))
    return [below, theta] if below > 0 else []


def _build(reach: Reach, level: int, sid: int, start: int, stop: int, budget: int) -> list[_Node]:
    """A pipeline of layers ``start..stop-1`` on at most ``budget`` components of ``level``
    within the bottleneck in use, for the work share ``reach.shares[level][sid]``.

    Prefers one stage (fewest replicas that fit), then the first stage with the fewest
    replicas and as many layers as possible.
    """
    only, sids = np.zeros(1, dtype=np.int64), np.array(sid)
    table = None
    if level == 0 and reach.many_workers:
        need = reach.fewest_workers(only, sid, start, stop)[0]
    else:
        table = reach.stage_table(level, sid)
        need = reach.fewest(level, sid, stop)
    nodes: list[_Node] = []
    while True:
        components = np.arange(1, budget + 1)
        if table is None:
            limits = reach.limits(level, only, sids, components)
            stage = reach.stage_reach(level, only, sids, components, start, limits)
        else:
            stage = table[:budget, start]
        fits = np.flatnonzero(stage >= stop)
        if fits.size:
            return [*nodes, _node(reach, level, sid, start, stop, int(fits[0]) + 1)]
        # the first stage on at most f = 1..budget-1 components, to its furthest cut
        furthest = np.minimum(np.maximum.accumulate(stage)[:-1], stop - 1)
        cuts = reach.last_cut(level, reach.cut_base(sids, only), furthest)
        ok = (cuts > start) & (need[np.maximum(cuts, 0)] <= budget - components[:-1])
        if not ok.any():
            raise AssertionError(f"no pipeline of layers {start}..{stop - 1}")
        cut = int(cuts[np.argmax(ok)])
        replicas = int(np.argmax(stage >= cut)) + 1
        nodes.append(_node(reach, level, sid, start, cut, replicas))
        start, budget = cut, budget - replicas


def _node(reach: Reach, level: int, sid: int, start: int, stop: int, replicas: int) -> _Node:
    """One stage and, above level 0, its pipeline inside one component."""
    inner: tuple[_Node, ...] = ()
    if level > 0:
        share = int(reach.children[level][sid, replicas - 1])
        count = reach.levels[level - 1].count
        inner = tuple(_build(reach, level - 1, share, start, stop, count))
    return _Node(start, stop, replicas, inner)


def _time(reach: Reach, level: int, nodes: Sequence[_Node], share: float) -> float:
    """Exact bottleneck of a pipeline at ``level`` doing ``share`` of the work."""
    bandwidth = reach.levels[level].bandwidth
    worst = 0.0
    for index, node in enumerate(nodes):
        part = share / node.replicas
        if level == 0:
            work = part * (reach.compute[node.stop] - reach.compute[node.start])
        else:
            work = _time(reach, level - 1, node.inner, part)
        weights = reach.weights[node.stop] - reach.weights[node.start]
        sync = (
            2
            * (node.replicas - 1)
            / node.replicas
            * weights
            / bandwidth
            * (1.0 if reach.sync == "step" else share / node.replicas)
        )
        worst = max(worst, work, sync)
        if index < len(nodes) - 1:
            worst = max(worst, share * reach.cut_bytes[node.stop] / bandwidth)
    return float(worst)


def _flatten(nodes: Sequence[_Node], multiplier: int) -> list[ReplicatedStage]:
    """Stages of a nested plan in pipeline order, replicas multiplied down the levels."""
    stages = []
    for node in nodes:
        if node.inner:
            stages += _flatten(node.inner, multiplier * node.replicas)
        else:
            stages.append(ReplicatedStage(node.start, node.stop, multiplier * node.replicas))
    return stages
