"""What a layer costs at every sequence length: measured at a few, fitted, predicted at any.

A transformer layer's forward (or backward) on ``rows`` sequences of ``length`` tokens costs
about ``a + b·tokens + c·rows·length²`` with ``tokens = rows·length``: a fixed cost per
call, the per-token work (projections, MLPs, norms) and attention, quadratic in the length
of each sequence. :func:`measure_lengths` profiles a model at several shapes and fits the
three coefficients per layer and pass (non-negative least squares of the errors relative
to the measured times, solved exactly over the subsets of the three terms);
:meth:`LengthCosts.costs` turns the shapes of a step's micro-batches into the simulator's
:class:`~pipetrain.simulation.Costs`, whose ``compute_scale`` gives each micro-batch its
own time, and :meth:`LengthCosts.profile` into the planner's
:class:`~pipetrain.profiler.Profile` for micro-batches of those shapes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pipetrain.checks import positive_int
from pipetrain.profiler.costs import Profile, _scaled_layer
from pipetrain.simulation import Costs

Coefficients = tuple[float, float, float]
"""``(per call, per token, per token × length)`` seconds."""

Shape = tuple[int, int]
"""A micro-batch's ``(rows, length)``."""


def features(rows: int, length: int) -> tuple[float, float, float]:
    """The three terms a micro-batch of ``rows`` sequences of ``length`` tokens pays."""
    return 1.0, float(rows * length), float(rows * length * length)


def fit(shapes: Sequence[Shape], seconds: Sequence[float]) -> Coefficients:
    """The non-negative coefficients whose :func:`features` best predict ``seconds``,
    each time's error relative to it (least squares of the relative errors, so a small
    micro-batch's time counts as much as a large one's): the best fit over every subset
    of the terms that leaves none negative."""
    if len(shapes) != len(seconds) or not shapes:
        raise ValueError("fit needs one time for each shape, and at least one")
    measured = np.array(seconds, dtype=float)
    weight = 1 / np.maximum(measured, 1e-9)  # a time too short to measure weighs as 1 ns
    x = np.array([features(r, n) for r, n in shapes]) * weight[:, None]
    y = measured * weight
    scale = np.maximum(x.max(axis=0), 1e-30)  # columns of very different sizes
    best: tuple[float, list[float]] = (np.inf, [0.0, 0.0, 0.0])
    for size in range(1, 4):
        for terms in itertools.combinations(range(3), size):
            solved = np.linalg.lstsq(x[:, terms] / scale[list(terms)], y, rcond=None)[0]
            if (solved < 0).any():
                continue
            coefficients = [0.0, 0.0, 0.0]
            for term, value in zip(terms, solved / scale[list(terms)]):
                coefficients[term] = float(value)
            error = float(((x @ np.array(coefficients) - y) ** 2).sum())
            if error < best[0]:
                best = (error, coefficients)
    a, b, c = best[1]
    return a, b, c


def _at(coefficients: Coefficients, shape: Shape) -> float:
    return sum(k * f for k, f in zip(coefficients, features(*shape)))


@dataclass(frozen=True)
class LengthCosts:
    """Each layer's fitted forward and backward :data:`Coefficients`."""

    forward: list[Coefficients]
    backward: list[Coefficients]

    def layer_seconds(self, shape: Shape) -> tuple[list[float], list[float]]:
        """Every layer's forward and backward seconds on a micro-batch of ``shape``."""
        return (
            [_at(k, shape) for k in self.forward],
            [_at(k, shape) for k in self.backward],
        )

    def stage_seconds(self, balance: Sequence[int], shape: Shape) -> tuple[list[float], ...]:
        """Each stage's forward and backward seconds (its layers' sums, ``balance`` layers
        a stage in order) on a micro-batch of ``shape``."""
        if sum(balance) != len(self.forward):
            raise ValueError(
                f"balance {list(balance)} covers {sum(balance)} layers, the costs "
                f"{len(self.forward)}"
            )
        forward, backward = self.layer_seconds(shape)
        bounds = list(itertools.accumulate(balance, initial=0))
        return tuple(
            [sum(times[start:stop]) for start, stop in itertools.pairwise(bounds)]
            for times in (forward, backward)
        )

    def costs(self, balance: Sequence[int], shapes: Sequence[Shape], base: Costs) -> Costs:
        """``base`` (its messages, links and steps) with each stage's forward and backward
        the mean over the micro-batches of ``shapes`` and each micro-batch's own time as
        ``compute_scale`` (its activation bytes in proportion to its tokens)."""
        per = [self.stage_seconds(balance, shape) for shape in shapes]
        stages = len(balance)
        forward = [sum(f[s] for f, _ in per) / len(per) for s in range(stages)]
        backward = [sum(b[s] for _, b in per) / len(per) for s in range(stages)]
        scale = [
            [(f[s] + b[s]) / max(forward[s] + backward[s], 1e-30) for s in range(stages)]
            for f, b in per
        ]
        tokens = [rows * length for rows, length in shapes]
        mean_tokens = sum(tokens) / len(tokens)
        return replace(
            base,
            forward_s=forward,
            backward_s=backward,
            weight_s=0.0,
            compute_scale=scale,
            bytes_scale=[t / mean_tokens for t in tokens],
        )

    def profile(
        self, base: Profile, base_shape: Shape, shapes: Sequence[Shape], microbatch_size: int
    ) -> Profile:
        """``base`` (the same model profiled on micro-batches of ``base_shape``) as the
        planner should see micro-batches of ``shapes``, ``microbatch_size`` samples each:
        every layer's forward and backward the fitted costs' mean over ``shapes`` (its
        weight-gradient share kept), its activation and memory bytes scaled by their mean
        tokens."""
        if len(base.layers) != len(self.forward):
            raise ValueError(
                f"the profile has {len(base.layers)} layers, the fitted costs {len(self.forward)}"
            )
        if not shapes:
            raise ValueError("LengthCosts.profile needs the shape of at least one micro-batch")
        per = [self.layer_seconds(shape) for shape in shapes]
        tokens = sum(rows * length for rows, length in shapes) / len(shapes)
        ratio = tokens / (base_shape[0] * base_shape[1])
        layers = []
        for index, layer in enumerate(base.layers):
            scaled = _scaled_layer(layer, ratio)
            forward = sum(f[index] for f, _ in per) / len(per)
            backward = sum(b[index] for _, b in per) / len(per)
            weight = layer.weight_backward_s
            share = None if weight is None else weight / max(layer.backward_s, 1e-30)
            layers.append(
                replace(
                    scaled,
                    forward_s=forward,
                    backward_s=backward,
                    weight_backward_s=None if share is None else share * backward,
                )
            )
        return replace(
            base,
            layers=layers,
            microbatch_size=microbatch_size,
            input_bytes=base.input_bytes * ratio,
            spread=None,
            other_sizes=(),
        )


def measure_lengths(profile_at: Callable[[Shape], Any], shapes: Sequence[Shape]) -> LengthCosts:
    """Profile at every shape of ``shapes`` (``profile_at(shape)`` returns a
    :class:`~pipetrain.profiler.Profile`, say :func:`~pipetrain.profiler.profile` on
    random tokens of that shape) and fit each layer's forward and backward."""
    if len(shapes) < 3:
        raise ValueError(
            f"measure_lengths needs at least 3 shapes to fit 3 terms, got {len(shapes)}"
        )
    for rows, length in shapes:
        positive_int("rows", rows)
        positive_int("length", length)
    profiles = [profile_at(shape) for shape in shapes]
    layers = len(profiles[0].layers)
    return LengthCosts(
        forward=[fit(shapes, [p.layers[i].forward_s for p in profiles]) for i in range(layers)],
        backward=[fit(shapes, [p.layers[i].backward_s for p in profiles]) for i in range(layers)],
    )
