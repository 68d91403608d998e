"""Batch normalization in a pipeline: with every recompute mode the running statistics
are updated once per micro-batch, as the unpipelined model run micro-batch by micro-batch;
deferred batch norm updates them once per step, as the unpipelined model on the whole
batch."""

from __future__ import annotations

import functools
from typing import Any

import batchnorm_cases as cases
import pytest
import torch

import pipetrain
from pipetrain.runtime.rank.batchnorm import deferred_layers
from pipetrain.schedules import build

reference = functools.cache(cases.reference)  # shared by the layouts of one micro-batching


@pytest.fixture(scope="module")
def two_ranks() -> list[list[dict[str, Any]]]:
    return pipetrain.launch(cases.runs, 2, 2, timeout_s=300)


@pytest.fixture(scope="module")
def three_ranks() -> list[list[dict[str, Any]]]:
    return pipetrain.launch(cases.runs, 3, 3, timeout_s=300)


def assert_runs_match(per_rank: list[list[dict[str, Any]]], ranks: int) -> None:
    for index, config in enumerate(cases.configs(ranks)):
        expected = reference(config["microbatches"], config.get("deferred_batch_norm", False))
        state: dict[str, torch.Tensor] = {}
        for result in per_rank:
            run = result[index]
            assert run["losses"] == pytest.approx(expected["losses"], rel=1e-5), config
            state.update(run["state"])
        assert sorted(state) == sorted(expected["state"]), config
        for name, value in state.items():
            torch.testing.assert_close(
                value, expected["state"][name], rtol=1e-5, atol=1e-5, msg=f"{name}, {config}"
            )


def test_per_micro_batch_and_whole_batch_statistics_differ() -> None:
    micro = reference(4, False)["state"]
    whole = reference(4, True)["state"]
    for name in ("0.1.running_var", "4.norm2.running_mean"):
        assert not torch.allclose(micro[name], whole[name]), name
    assert int(micro["0.1.num_batches_tracked"]) == 4 * cases.STEPS
    assert int(whole["0.1.num_batches_tracked"]) == cases.STEPS
    assert torch.equal(micro["0.0.weight"], whole["0.0.weight"])


def test_two_ranks_update_buffers_once_per_forward_in_every_recompute_mode(
    two_ranks: list[list[dict[str, Any]]],
) -> None:
    assert_runs_match(two_ranks, 2)


@pytest.mark.slow
def test_three_ranks_update_buffers_once_per_forward_in_every_recompute_mode(
    three_ranks: list[list[dict[str, Any]]],
) -> None:
    assert_runs_match(three_ranks, 3)


def test_deferred_batch_norm_evaluates_as_batch_norm_and_refuses_split_steps() -> None:
    x = cases.images(0)[0]
    torch.testing.assert_close(cases.deferred_eval(x), cases.resnet().eval()(x))
    layers = [("0", cases.resnet())]
    for name, replicas in (("2bw", None), ("1f1b", [2, 1])):
        schedule = build(name, 3 if replicas else 2, 4, replicas=replicas)
        with pytest.raises(ValueError, match="deferred_batch_norm needs every micro-batch"):
            deferred_layers(layers, schedule)
