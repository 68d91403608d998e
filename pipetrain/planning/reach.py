"""Feasibility tests behind the replication planner (:mod:`pipetrain.planning.replicate`).

For a candidate bottleneck ``θ`` they answer how far a pipeline of replicated stages can get
through the layers under the planner's cost model. A stage's feasibility is monotone in its
start (a later start leaves less to hold), in its stop and in ``θ``, so a pipeline's first
stages may as well end at the furthest allowed cut they reach:

- :meth:`Reach.furthest`: from given starts, the furthest stop on at most ``b`` components
  is a maximum over the components ``f`` of the last stage, run from the furthest cut that
  ``b - f`` components reach: ``O(m²)`` stage tests per start and level, a stage above
  level 0 asking the level below from its own start. The bisection asks it from the first
  layer only.
- :meth:`Reach.pipeline_table`: the same from every start at once, the first stage ending at
  the furthest cut it reaches, for building the plan: ``O(n · m²)`` table look-ups.
- :meth:`Reach.fewest_workers`: the fewest workers that cover every suffix of the layers,
  for one level with many more workers than layers: ``O(n²)`` stage tests, each stage on
  the fewest workers that fit it.

Every test runs for a batch of bottlenecks at once and reproduces the planner's
floating-point comparisons exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from pipetrain.planning.topology import Level

NOWHERE = np.iinfo(np.int64).max // 4
"""Components "needed" where no pipeline exists."""


class Reach:
    """Prefix sums of one problem and its tests for the bottlenecks in use (:meth:`use`).

    A query names its bottleneck by index ``ti`` into ``thetas`` and its work share by index
    ``sid`` into ``shares[level]``; ``children[level][sid, r - 1]`` is the share of one
    component of an ``r``-way stage at ``level``. Positions run ``0..n``: the stage of layers
    ``x..e-1`` starts at ``x`` and stops at ``e``.
    """

    def __init__(
        self,
        compute: np.ndarray,
        weight_bytes: np.ndarray,
        activation_bytes: np.ndarray,
        levels: Sequence[Level],
        sync: str,
    ) -> None:
        """Prefix sums of compute and weights; the bytes crossing a cut before each layer."""
        self.n = len(compute)
        self.compute = np.concatenate(([0.0], np.cumsum(compute)))
        self.weights = np.concatenate(([0.0], np.cumsum(weight_bytes)))
        self.cut_bytes = np.concatenate(
            ([0.0], 2 * np.asarray(activation_bytes[:-1], dtype=float), [0.0])
        )
        self.positions = np.arange(self.n + 1)
        self.inner = (self.positions > 0) & (self.positions < self.n)
        self.levels = tuple(levels)
        self.sync = sync
        self.shares = [np.ones(1)] * len(levels)
        self.children = [np.zeros((1, 0), dtype=np.int64)] * len(levels)
        for level in range(len(levels) - 1, 0, -1):
            index: dict[float, int] = {}
            self.children[level] = np.array(
                [
                    [index.setdefault(float(share) / r, len(index)) for r in self.components(level)]
                    for share in self.shares[level]
                ]
            )
            self.shares[level - 1] = np.array(list(index))
        self.thetas = np.zeros(1)
        self._last_cuts: dict[int, np.ndarray] = {}
        self._tables: dict[tuple[int, int, int], np.ndarray] = {}

    def components(self, level: int) -> np.ndarray:
        """``1..count`` of ``level``."""
        return np.arange(1, self.levels[level].count + 1)

    def use(self, thetas: Sequence[float]) -> None:
        """Test the bottlenecks ``thetas`` from now on."""
        self.thetas = np.asarray(thetas, dtype=float)
        self._last_cuts = {}
        self._tables = {}

    def cut_base(self, sid: np.ndarray, ti: np.ndarray) -> np.ndarray:
        """Offsets of the queries' rows in :meth:`last_cut`'s flattened tables."""
        return (sid * len(self.thetas) + ti) * (self.n + 1)

    def last_cut(self, level: int, base: np.ndarray, x: np.ndarray) -> np.ndarray:
        """The largest allowed cut position ``c <= x`` (``-1`` if none), ``base`` from
        :meth:`cut_base`."""
        table = self._last_cuts.get(level)
        if table is None:
            cost = self.shares[level][:, None] * self.cut_bytes / self.levels[level].bandwidth
            allowed = self.inner & (cost[:, None, :] <= self.thetas[None, :, None])
            table = np.maximum.accumulate(np.where(allowed, self.positions, -1), axis=2).ravel()
            self._last_cuts[level] = table
        return table.take(base + x)

    def limits(
        self, level: int, ti: np.ndarray, sid: np.ndarray, r: np.ndarray
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """What one stage on ``r`` components may hold: the compute it may add (level 0
        only) and the weight bytes its all-reduce may carry (``None``: no limit)."""
        share, theta = self.shares[level][sid], self.thetas[ti]
        step = theta * r / share if level == 0 else None
        scale = 1.0 if self.sync == "step" else share / r
        per_byte = 2 * (r - 1) / (r * self.levels[level].bandwidth) * scale
        synced = per_byte > 0
        if not synced.any():
            return step, None
        return step, np.where(synced, theta / np.where(synced, per_byte, 1.0), np.inf)

    def stage_reach(
        self,
        level: int,
        ti: np.ndarray,
        sid: np.ndarray,
        r: np.ndarray,
        x: np.ndarray | int,
        limits: tuple[np.ndarray | None, np.ndarray | None],
        inner: np.ndarray | None = None,
    ) -> np.ndarray:
        """Furthest stop (``>= x``) of one stage from ``x`` on ``r`` components, arrays
        broadcast, ``limits`` from :meth:`limits`; above level 0, ``inner`` is how far the
        level below reaches from ``x`` (asked of :meth:`furthest` if not given)."""
        step, sync = limits
        if step is not None:
            reach = np.searchsorted(self.compute, self.compute.take(x) + step, side="right")
        else:
            if inner is None:
                ti, sid, r, x = np.broadcast_arrays(ti, sid, r, x)
                below, child = self.levels[level - 1].count, self.children[level][sid, r - 1]
                rows = self.furthest(level - 1, ti.ravel(), child.ravel(), x.ravel(), below)
                inner = rows[-1].reshape(x.shape)
            reach = inner + 1
        if sync is not None:
            limit = self.weights.take(x) + sync
            reach = np.minimum(reach, np.searchsorted(self.weights, limit, side="right"))
        return reach - 1

    def furthest(
        self, level: int, ti: np.ndarray, sid: np.ndarray, x: np.ndarray, budget: int
    ) -> np.ndarray:
        """``[b - 1, q]``: furthest stop of a pipeline from ``x[q]`` on at most ``b`` components
        (``b <= budget``) of ``level``."""
        components = np.arange(1, budget + 1)[:, None]
        step, sync = self.limits(level, ti, sid, components)
        base = self.cut_base(sid, ti)
        cuts = np.empty((budget, len(x)), dtype=np.int64)  # [j]: furthest cut on j components
        cuts[0] = x
        rows = np.empty_like(cuts)
        for b in range(1, budget + 1):
            limits = (None if step is None else step[:b], None if sync is None else sync[:b])
            # the last stage on f = 1..b components, from the furthest cut of b - f
            reach = self.stage_reach(level, ti, sid, components[:b], cuts[b - 1 :: -1], limits)
            rows[b - 1] = reach.max(axis=0)
            if b < budget:
                cuts[b] = np.maximum(cuts[b - 1], self.last_cut(level, base, rows[b - 1]))
        return rows

    def stage_table(self, level: int, sid: int) -> np.ndarray:
        """``[r - 1, x]``: furthest stop of one stage from every ``x`` on ``r`` components, at
        the first bottleneck in use."""
        key = (level, sid, 1)
        if key not in self._tables:
            components = self.components(level)[:, None]
            only, sids = np.zeros(1, dtype=np.int64), np.array(sid)
            inner = None
            if level > 0:
                below = self.children[level][sid]
                inner = np.stack([self.pipeline_table(level - 1, child)[-1] for child in below])
            limits = self.limits(level, only, sids, components)
            reach = self.stage_reach(level, only, sids, components, self.positions, limits, inner)
            self._tables[key] = reach
        return self._tables[key]

    def pipeline_table(self, level: int, sid: int) -> np.ndarray:
        """``[b - 1, x]``: furthest stop of a pipeline from every ``x`` on at most ``b``
        components, at the first bottleneck in use; the first stage ends at the furthest cut
        that ``f`` components reach and the rest runs on ``b - f``."""
        key = (level, sid, 0)
        if key not in self._tables:
            single = np.maximum.accumulate(self.stage_table(level, sid), axis=0)
            base = self.cut_base(np.array(sid), np.zeros(1, dtype=np.int64))
            cut = self.last_cut(level, base, single)
            # a first stage that cannot end at a cut leads to the last column, which reaches -1
            cut = np.where(cut > self.positions, cut, self.n + 1)
            reach = np.full((len(single), self.n + 2), -1)
            reach[0, :-1] = single[0]
            for b in range(2, len(single) + 1):
                rest = np.arange(b - 2, -1, -1)[:, None]  # components left after the first
                further = reach[rest, cut[: b - 1]].max(axis=0)
                reach[b - 1, :-1] = np.maximum(single[b - 1], further)
            self._tables[key] = reach[:, :-1]
        return self._tables[key]

    def fewest(self, level: int, sid: int, stop: int) -> np.ndarray:
        """``[x]``: fewest components of ``level`` whose pipeline covers layers ``x..stop-1``
        at the first bottleneck in use (:data:`NOWHERE` where none does)."""
        covers = self.pipeline_table(level, sid) >= stop
        return np.where(covers.any(axis=0), covers.argmax(axis=0) + 1, NOWHERE)

    def fewest_workers(self, ti: np.ndarray, sid: int, start: int, stop: int) -> np.ndarray:
        """``[t, x]``: as :meth:`fewest` at level 0, for each of the bottlenecks ``ti``.

        Stage ``x..e-1`` gets the fewest workers its compute needs (estimated, then settled
        by the exact test). Where its all-reduce then takes too long, more workers cannot
        help under ``"step"`` (they lengthen it) and may under ``"replica"`` (from two
        workers up they shorten it): the fewest that do, if any.
        """
        count, share, sids = self.levels[0].count, self.shares[0][sid], np.array(sid)
        theta = self.thetas[ti][:, None]
        x, e = np.triu_indices(stop - start + 1, k=1)  # every stage, by start
        firsts = np.concatenate(([0], np.cumsum(np.arange(stop - start, 0, -1))))
        x, e = x + start, e + start
        low, high = self.compute.take(x), self.compute.take(e)
        weights_low, weights_high = self.weights.take(x), self.weights.take(e)

        def fits(r: np.ndarray) -> np.ndarray:
            return high <= low + theta * r / share

        def synced(r: np.ndarray) -> np.ndarray:
            limit = self.limits(0, ti[:, None], sids, r)[1]
            return np.full(r.shape, True) if limit is None else weights_high <= weights_low + limit

        with np.errstate(divide="ignore", invalid="ignore"):
            guess = np.ceil((high - low) * share / theta)
        guess = np.nan_to_num(guess, nan=count + 1.0).clip(1, count + 1).astype(np.int64)
        below, above = np.maximum(guess - 1, 1), np.minimum(guess + 1, count + 1)
        below = np.where((below > 1) & fits(np.maximum(below - 1, 1)), 1, below)
        above = np.where((above <= count) & ~fits(np.minimum(above, count)), count + 1, above)
        workers = _least(fits, below, above)
        ok = synced(workers)
        if self.sync == "step":  # more workers only lengthen the all-reduce
            workers = np.where(ok, workers, count + 1)
        else:  # ... or, from two workers up, shorten it
            later = _least(
                synced, np.minimum(workers + 1, count + 1), np.full_like(workers, count + 1)
            )
            workers = np.where(ok, workers, later)
        ends = (e == stop) | (self.last_cut(0, self.cut_base(sids, ti)[:, None], e) == e)
        cost = np.where(ends & (workers <= count), workers, NOWHERE)
        need = np.full((len(ti), stop + 1), NOWHERE)
        need[:, stop] = 0
        for offset in range(stop - start - 1, -1, -1):
            stages = slice(firsts[offset], firsts[offset + 1])
            need[:, start + offset] = (cost[:, stages] + need[:, e[stages]]).min(axis=1)
        return need

    def feasible(self, thetas: Sequence[float]) -> np.ndarray:
        """Whether some plan on the whole topology has bottleneck <= each of ``thetas``."""
        self.use(thetas)
        top = len(self.levels) - 1
        count, batch = self.levels[top].count, np.arange(len(self.thetas))
        if self.many_workers:
            return self.fewest_workers(batch, 0, 0, self.n)[:, 0] <= count
        zeros = np.zeros_like(batch)
        return self.furthest(top, batch, zeros, zeros, count)[-1] >= self.n

    @property
    def many_workers(self) -> bool:
        """One level with more than twice as many workers as layers."""
        return len(self.levels) == 1 and self.levels[0].count > 2 * self.n


def _least(
    test: Callable[[np.ndarray], np.ndarray], low: np.ndarray, high: np.ndarray
) -> np.ndarray:
    """Per element, the least ``r`` in ``[low, high)`` that passes ``test`` (monotone: false,
    then true), or ``high`` if none does; by bisection."""
    while np.any(low < high):
        middle = (low + high) // 2
        passed = (low < high) & test(np.minimum(middle, high - 1).clip(1))
        high = np.where(passed, middle, high)
        low = np.where((low < high) & ~passed, middle + 1, low)
    return low
