"""Mixed precision against the unpipelined autocast loop: fp16 loss scaling skips the same
updates as torch.amp.GradScaler and backs off the same way, on every rank; bf16 trains as
unpipelined autocast on the same micro-batches; settings that cannot run are refused."""

from __future__ import annotations

from typing import Any

import precision_cases as cases
import pytest
import torch

import pipetrain
from pipetrain.runtime.rank.precision import LossScale, Precision


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return pipetrain.launch(cases.two_rank_checks, 2, timeout_s=300)


@pytest.fixture(scope="module")
def three_ranks() -> list[dict[str, Any]]:
    return pipetrain.launch(cases.three_rank_checks, 3, timeout_s=300)


def assert_loop_matches(results: list[dict[str, Any]], config: dict[str, Any]) -> None:
    """Every rank's losses, skipped updates and scales, and the weights of the stages' first
    ranks, equal the unpipelined loop's."""
    expected = cases.reference_loop(config["precision"], config["microbatches"])
    if config["precision"] == "fp16":
        assert any(expected["skipped"]) and not all(expected["skipped"]), (
            "the reference must both overflow and apply updates"
        )
    for result in results:
        assert result["skipped"] == expected["skipped"]
        assert result["losses"] == pytest.approx(expected["losses"], rel=1e-4)
        if config["precision"] == "fp16":
            assert result["scales"] == expected["scales"]
    state: dict[str, torch.Tensor] = {}
    for result in reversed(results):  # replicas hold equal weights; the first rank wins
        state.update(result["state"])
    assert sorted(state) == sorted(expected["state"])
    for name, value in expected["state"].items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("index", range(len(cases.TWO_RANK_LOOPS)))
def test_two_stages_match_unpipelined_autocast(two_ranks: list[dict[str, Any]], index: int) -> None:
    assert_loop_matches([rank["loops"][index] for rank in two_ranks], cases.TWO_RANK_LOOPS[index])


@pytest.mark.parametrize("index", range(len(cases.THREE_RANK_LOOPS)))
def test_parameter_free_and_replicated_stages_skip_with_every_rank(
    three_ranks: list[dict[str, Any]], index: int
) -> None:
    assert_loop_matches(
        [rank["loops"][index] for rank in three_ranks], cases.THREE_RANK_LOOPS[index]
    )


def test_settings_that_cannot_run_are_refused(two_ranks: list[dict[str, Any]]) -> None:
    unknown, no_optimizer, asynchronous = two_ranks[0]["refusals"]
    assert "precision must be one of fp32, bf16, fp16, got 'fp8'" in unknown
    assert "precision='fp16'" in no_optimizer and "optimizer=" in no_optimizer
    assert "pipedream" in asynchronous and "bf16" in asynchronous


def test_a_loss_scale_that_cannot_scale_is_refused() -> None:
    with pytest.raises(ValueError, match="backoff_factor"):
        LossScale(backoff_factor=1.5)


def test_the_scale_follows_grad_scaler_and_round_trips_its_state() -> None:
    policy = LossScale(init_scale=8.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=2)
    precision = Precision("fp16", torch.device("cpu"), policy)
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=8.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=2
    )
    parameter = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([parameter], lr=0.0)
    scaler.scale(torch.ones(()))  # GradScaler sets its scale up at the first scaling
    for overflow in (False, False, True, False, True, False, False, False):
        parameter.grad = torch.full((3,), float("inf") if overflow else 1.0)
        scaler.step(optimizer)
        scaler.update()
        precision.update(overflow)
        assert precision.scale == scaler.get_scale()
    copy = Precision("fp16", torch.device("cpu"), policy)
    copy.load_state_dict(precision.state_dict())
    for overflow in (False, True):
        precision.update(overflow)
        copy.update(overflow)
        assert copy.scale == precision.scale
