"""Asynchronous schedules apply exactly PipeDream's, vertical sync's and 2BW's update rules."""

from __future__ import annotations

from collections.abc import Callable

import pipeline_cases as cases
import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.model.layers import StageModule, stage_bounds, to_layers
from pipetrain.runtime.rank.reduce import DEFAULT_BUCKET_BYTES

LR = 0.2


def stage_of(balance: list[int]) -> dict[str, int]:
    """Parameter name -> stage index, from the balance."""
    owner = {}
    for stage, (start, stop) in enumerate(stage_bounds(balance)):
        for index in range(start, stop):
            for name, _ in cases.mlp()[index].named_parameters():
                owner[f"{index}.{name}"] = stage
    return owner


def reference(
    balance: list[int],
    rule: Callable[[int, int], int],
    per_update: int,
    updates: int,
    windows: int,
    max_norm: float | None = None,
) -> dict[str, torch.Tensor]:
    """Replay the rule in one process: update u of every stage uses the gradient of the
    mini-batch made of micro-batches u·per_update … (u+1)·per_update − 1, computed with
    stage s on weight version ``rule(s, u)`` (counted from the window's start); with
    ``max_norm``, that gradient is clipped by its global norm over every stage."""
    model = StageModule(to_layers(cases.mlp()))
    owner = stage_of(balance)
    versions = [
        {name: p.detach().clone() for name, p in model.named_parameters()}
    ]  # versions[v][name]
    for window in range(windows):
        base = len(versions) - 1
        x, y = cases.batch(seed=10 + window, size=per_update * updates * 2)
        inputs, targets = torch.tensor_split(x, updates), torch.tensor_split(y, updates)
        for update in range(updates):
            weights = {
                name: versions[base + rule(owner[name], update)][name].clone().requires_grad_(True)
                for name in owner
            }
            loss = nn.functional.cross_entropy(
                torch.func.functional_call(model, weights, (inputs[update],)), targets[update]
            )
            grads = dict(zip(weights, torch.autograd.grad(loss, list(weights.values()))))
            if max_norm is not None:
                norm = torch.stack([g.norm() for g in grads.values()]).norm()
                grads = {n: g * min(1.0, max_norm / (float(norm) + 1e-6)) for n, g in grads.items()}
            versions.append({name: versions[-1][name] - LR * grads[name] for name in owner})
    return versions[-1]


def run(
    schedule: str,
    balance: list[int],
    microbatches: int,
    windows: int,
    settings: dict[str, object] | None = None,
    **schedule_options: object,
) -> dict[str, torch.Tensor]:
    states = pipetrain.launch(
        cases.asynchronous_runs,
        len(balance),
        schedule,
        balance,
        microbatches,
        windows,
        schedule_options,
        settings,
        timeout_s=300,
    )
    merged = {}
    for state in states:
        merged.update(state)
    return merged


def assert_equal_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("balance", [[2, 3], [1, 2, 2]])
def test_pipedream_weight_stashing(balance: list[int]) -> None:
    p, window = len(balance), 5
    # stage s runs mini-batch k on the weights after k − (p − s) + 1 updates: the newest it has
    expected = reference(balance, lambda s, k: max(0, k - (p - s) + 1), 1, window, windows=2)
    assert_equal_weights(run("pipedream", balance, window, 2), expected)


@pytest.mark.parametrize("balance", [[2, 3], [1, 2, 2]])
def test_pipedream_vertical_sync(balance: list[int]) -> None:
    p, window = len(balance), 5
    # every stage uses the version the input stage used: k − p + 1
    expected = reference(balance, lambda s, k: max(0, k - p + 1), 1, window, windows=2)
    assert_equal_weights(run("pipedream", balance, window, 2, vertical_sync=True), expected)


@pytest.mark.parametrize("balance, per_update", [([2, 3], 2), ([1, 2, 2], 3)])
def test_2bw_one_step_delay(balance: list[int], per_update: int) -> None:
    rounds = 3
    # W(t+1) = W(t) − ν·∇f(W(t−1)), with W(−1) = W(0) at the window's start
    expected = reference(balance, lambda s, t: max(0, t - 1), per_update, rounds, windows=2)
    assert_equal_weights(run("2bw", balance, per_update, 2, rounds=rounds), expected)


MAX_NORM = 0.3  # below every update's global norm here, so each update is clipped


@pytest.mark.parametrize("balance", [[2, 3], [1, 2, 2]])
def test_pipedream_clips_by_the_global_norm_of_each_update(balance: list[int]) -> None:
    p, window = len(balance), 5
    rule = lambda s, k: max(0, k - p + 1)  # noqa: E731  (vertical sync's versions)
    expected = reference(balance, rule, 1, window, windows=2, max_norm=MAX_NORM)
    unclipped = reference(balance, rule, 1, window, windows=2)
    assert any(not torch.allclose(expected[n], unclipped[n]) for n in expected)
    got = run("pipedream", balance, window, 2, {"max_grad_norm": MAX_NORM}, vertical_sync=True)
    assert_equal_weights(got, expected)


def test_2bw_clips_by_the_global_norm_of_each_update() -> None:
    balance, per_update, rounds = [1, 2, 2], 3, 3
    rule = lambda s, t: max(0, t - 1)  # noqa: E731
    expected = reference(balance, rule, per_update, rounds, windows=2, max_norm=MAX_NORM)
    got = run("2bw", balance, per_update, 2, {"max_grad_norm": MAX_NORM}, rounds=rounds)
    assert_equal_weights(got, expected)


def test_clipping_refuses_pipedream_without_vertical_sync() -> None:
    with pytest.raises(pipetrain.LaunchError, match="vertical_sync"):
        run("pipedream", [2, 3], 4, 1, {"max_grad_norm": MAX_NORM})


def test_stale_rules_differ_from_plain_sgd() -> None:
    """The rules above are not all the same update: the test would catch a wrong version."""
    balance = [2, 3]
    stashed = reference(balance, lambda s, k: max(0, k - (2 - s) + 1), 1, 5, windows=1)
    synchronous = reference(balance, lambda s, k: k, 1, 5, windows=1)
    assert any(not torch.allclose(stashed[n], synchronous[n]) for n in stashed)


@pytest.mark.parametrize("bucket_bytes", [DEFAULT_BUCKET_BYTES, 1])
def test_pipedream_with_a_replicated_stage(bucket_bytes: float) -> None:
    """Stage 0 on 2 replicas (mini-batches round-robin), stage 1 on one worker.

    Stage 1 updates after every mini-batch k, on version k. Each stage-0 replica keeps 2
    mini-batches in flight, so its i-th local mini-batch (k = 2i + replica) runs on version
    max(0, i − 1); the replicas average the gradients of mini-batches 2i and 2i + 1 and
    update together.
    """
    balance, window, windows = [2, 3], 6, 2
    owner = stage_of(balance)
    model = StageModule(to_layers(cases.mlp()))
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    versions = {0: [start], 1: [start]}  # per stage, the weights after each of its updates
    for index in range(windows):
        base = {stage: len(history) - 1 for stage, history in versions.items()}
        x, y = cases.batch(seed=10 + index, size=window * 2)
        pending: dict[str, torch.Tensor] = {}
        for k, (inputs, targets) in enumerate(
            zip(torch.tensor_split(x, window), torch.tensor_split(y, window))
        ):
            used = {0: base[0] + max(0, k // 2 - 1), 1: base[1] + k}
            weights = {
                n: versions[owner[n]][used[owner[n]]][n].clone().requires_grad_(True) for n in owner
            }
            loss = nn.functional.cross_entropy(
                torch.func.functional_call(model, weights, (inputs,)), targets
            )
            grads = dict(zip(weights, torch.autograd.grad(loss, list(weights.values()))))
            versions[1].append(
                {n: versions[1][-1][n] - LR * grads[n] for n in owner if owner[n] == 1}
            )
            if k % 2 == 0:
                pending = grads
            else:
                versions[0].append(
                    {
                        n: versions[0][-1][n] - LR * (pending[n] + grads[n]) / 2
                        for n in owner
                        if owner[n] == 0
                    }
                )
    expected = {**versions[0][-1], **versions[1][-1]}
    states = pipetrain.launch(
        cases.asynchronous_runs,
        3,
        "pipedream",
        balance,
        window,
        windows,
        {},
        {"replicas": [2, 1], "bucket_bytes": bucket_bytes},
        timeout_s=300,
    )
    for name, value in states[
        1
    ].items():  # the two replicas of stage 0 hold the same weights, bit for bit
        assert torch.equal(value, states[0][name]), name
    assert_equal_weights({**states[0], **states[2]}, expected)
