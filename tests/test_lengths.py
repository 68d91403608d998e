"""The length-aware cost model: coefficients fitted exactly where the times follow the
model, never negative, and a step's micro-batch shapes turned into simulator costs whose
one-rank makespan is the sum of the predicted times."""

from __future__ import annotations

import random

import pytest

from pipetrain.app.step_costs import CALIBRATION_WINDOW, calibrated
from pipetrain.profiler import LayerCost, Profile
from pipetrain.profiler.lengths import LengthCosts, features, fit, measure_lengths
from pipetrain.schedules import build
from pipetrain.simulation import Costs, simulate

SHAPES = [(2, 64), (2, 256), (2, 1024), (8, 128), (4, 512)]


def test_times_that_follow_the_model_are_fitted_exactly() -> None:
    chance = random.Random(0)
    for _ in range(50):
        truth = [chance.choice([0.0, chance.uniform(1e-4, 1e-2)]) for _ in range(3)]
        truth[1] *= 1e-4
        truth[2] *= 1e-7
        seconds = [sum(k * f for k, f in zip(truth, features(*s))) for s in SHAPES]
        assert fit(SHAPES, seconds) == pytest.approx(truth, rel=1e-6, abs=1e-15)


def test_a_fit_never_goes_negative() -> None:
    # times that fall with the length: the best non-negative fit is a constant, the one
    # whose errors relative to the times have the least sum of squares
    seconds = [5.0, 4.0, 3.0, 4.5, 3.5]
    coefficients = fit(SHAPES, seconds)
    assert min(coefficients) >= 0
    assert coefficients[1] == coefficients[2] == 0
    candidates = [3.0 + i / 10_000 for i in range(20_001)]
    best = min(candidates, key=lambda a: sum((a / t - 1) ** 2 for t in seconds))
    assert coefficients[0] == pytest.approx(best, abs=1e-4)
    with pytest.raises(ValueError, match="one time for each shape"):
        fit(SHAPES, [1.0])


def test_measured_profiles_fit_per_layer_and_predict_every_shape() -> None:
    truth = [(1e-3, 2e-6, 0.0), (5e-4, 1e-6, 3e-9)]

    def profile_at(shape: tuple[int, int]) -> Profile:
        layers = [
            LayerCost(forward_s=sum(k * f for k, f in zip(c, features(*shape))),
                      backward_s=2 * sum(k * f for k, f in zip(c, features(*shape))))
            for c in truth
        ]  # fmt: skip
        return Profile(layers)

    fitted = measure_lengths(profile_at, SHAPES)
    for got, want in zip(fitted.forward, truth):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-15)
    forward, backward = fitted.layer_seconds((3, 300))
    expected = [sum(k * f for k, f in zip(c, features(3, 300))) for c in truth]
    assert forward == pytest.approx(expected) and backward == pytest.approx(
        [2 * e for e in expected]
    )
    with pytest.raises(ValueError, match="at least 3 shapes"):
        measure_lengths(profile_at, SHAPES[:2])


def test_a_steps_shapes_become_costs_each_micro_batch_its_own() -> None:
    fitted = LengthCosts(forward=[(1e-3, 1e-6, 1e-9)] * 3, backward=[(2e-3, 2e-6, 2e-9)] * 3)
    shapes = [(4, 30), (1, 500), (2, 120)]
    costs = fitted.costs([2, 1], shapes, Costs(forward_s=0.0, backward_s=0.0))
    # one rank: the step is every micro-batch's predicted forward and backward, in turn
    by_hand = sum(
        sum(f) + sum(b) for f, b in (fitted.stage_seconds([2, 1], shape) for shape in shapes)
    )
    alone = fitted.costs([3], shapes, Costs(forward_s=0.0, backward_s=0.0))
    assert simulate(build("gpipe", 1, 3), alone).makespan == pytest.approx(by_hand)
    mean_tokens = (120 + 500 + 240) / 3
    assert costs.bytes_scale == pytest.approx([t / mean_tokens for t in (120, 500, 240)])
    with pytest.raises(ValueError, match="covers 4 layers"):
        fitted.stage_seconds([2, 2], (1, 10))


def test_a_profile_for_micro_batches_of_given_shapes() -> None:
    fitted = LengthCosts(forward=[(1e-3, 1e-6, 1e-9)] * 2, backward=[(2e-3, 2e-6, 2e-9)] * 2)
    layer = LayerCost(
        forward_s=9.0, backward_s=4.0, weight_backward_s=1.0, activation_bytes=800.0,
        parameter_bytes=50.0, optimizer_s=0.5,
    )  # fmt: skip
    base = Profile([layer, layer], microbatch_size=2, input_bytes=80.0)
    shapes = [(2, 100), (4, 25), (1, 300)]  # 200, 100 and 300 tokens against the base's 2 x 50
    got = fitted.profile(base, (2, 50), shapes, microbatch_size=3)
    assert got.microbatch_size == 3 and len(got) == 2
    forward = [sum(fitted.layer_seconds(s)[0][0] for s in shapes) / 3]
    backward = sum(fitted.layer_seconds(s)[1][0] for s in shapes) / 3
    for cost in got.layers:
        assert cost.forward_s == pytest.approx(forward[0])
        assert cost.backward_s == pytest.approx(backward)
        assert cost.weight_backward_s == pytest.approx(backward / 4)  # its measured share
        assert cost.activation_bytes == pytest.approx(1600.0)  # 200 mean tokens, twice 100
        assert (cost.parameter_bytes, cost.optimizer_s) == (50.0, 0.5)
    assert got.input_bytes == pytest.approx(160.0)
    with pytest.raises(ValueError, match="the profile has 2 layers, the fitted costs 3"):
        LengthCosts(forward=[(0, 0, 0)] * 3, backward=[(0, 0, 0)] * 3).profile(
            base, (2, 50), shapes, 3
        )


def test_the_planner_weighs_the_padding_each_micro_batch_count_leaves() -> None:
    """Per-token costs and a long document in every step: one micro-batch pads every
    document to it, sixteen pad none, and the plan takes sixteen. Equal lengths and a
    large cost per call: every micro-batch costs its calls again, and the plan takes one."""
    from pipetrain.app.corpus_plan import corpus_profile
    from pipetrain.planning import plan

    base = Profile([LayerCost(forward_s=1e-3, backward_s=2e-3)] * 4, microbatch_size=4)

    def chosen_count(fitted: LengthCosts, steps: list[list[int]]) -> int:
        profile = corpus_profile(fitted, base, (4, 100), steps, 16, None)
        counts = [1, 2, 4, 8, 16]
        chosen = plan(profile, workers=2, batch_size=16, microbatches=counts, schedules=["1f1b"])
        return chosen.microbatches

    per_token = LengthCosts(forward=[(0.0, 1e-6, 0.0)] * 4, backward=[(0.0, 2e-6, 0.0)] * 4)
    assert chosen_count(per_token, [[1000] + [10] * 15] * 3) == 16
    per_call = LengthCosts(forward=[(1e-2, 1e-8, 0.0)] * 4, backward=[(2e-2, 2e-8, 0.0)] * 4)
    assert chosen_count(per_call, [[100] * 16] * 3) == 1


def test_each_prediction_is_calibrated_by_the_steps_before_it_only() -> None:
    chance = random.Random(1)
    predicted = [chance.uniform(0.1, 1.0) for _ in range(80)]
    # a steady factor of 1.3 with noise, then a change to 0.8 from step 50
    measured = [p * (1.3 if i < 50 else 0.8) * chance.uniform(0.95, 1.05) for i, p in
                enumerate(predicted)]  # fmt: skip
    skip = 2
    corrected = calibrated(predicted, measured, skip)
    for step, guess in enumerate(corrected):
        window = list(range(max(skip, step - CALIBRATION_WINDOW), step))
        ratios = sorted(measured[i] / predicted[i] for i in window)
        if not ratios:
            assert guess == predicted[step]
            continue
        middle = len(ratios) // 2
        median = ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2
        assert guess == pytest.approx(predicted[step] * median)
    # a step's own time never enters its prediction
    changed = measured[:]
    changed[40] *= 100
    assert calibrated(predicted, changed, skip)[:41] == corrected[:41]
    # the steady factor is learnt: within the noise once the window is past the change
    assert all(abs(c / m - 1) < 0.1 for c, m in zip(corrected[3:50], measured[3:50]))
    assert all(abs(c / m - 1) < 0.1 for c, m in zip(corrected[70:], measured[70:]))
    with pytest.raises(ValueError, match="one measured time per prediction"):
        calibrated(predicted, measured[:-1], skip)
