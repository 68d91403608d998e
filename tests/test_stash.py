"""Weight versions: runs on a stashed version, gradients moved to the live parameters,
versions dropped when no later action needs them, and the optimizer's synchronous and
asynchronous stepping, each against a plain copy of the model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipetrain.runtime.rank.weights import Weights, WeightStash
from pipetrain.schedules import Action, Kind


def model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def grad(tensor: torch.Tensor) -> torch.Tensor:
    assert tensor.grad is not None, "no gradient"
    return tensor.grad


def output(value: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    assert isinstance(value, torch.Tensor)
    return value


def sgd_step(module: nn.Module, lr: float = 0.5) -> None:
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.sub_(lr * grad(parameter))


def test_a_version_runs_the_weights_it_was_taken_from() -> None:
    live = model()
    reference = copy.deepcopy(live)
    stash = WeightStash(live)
    with torch.no_grad():
        for parameter in live.parameters():
            parameter.add_(1.0)  # the live weights move on; version 0 must not
    x = torch.randn(5, 3)
    torch.testing.assert_close(output(stash.run(0, x)), reference(x))
    assert not torch.allclose(live(x), reference(x))


def test_gradients_of_several_versions_add_up_on_the_live_parameters() -> None:
    live = model()
    stash = WeightStash(live)
    old = copy.deepcopy(live)
    with torch.no_grad():
        next(live.parameters()).mul_(2.0)  # the first layer's weight
    stash.advance()  # version 1: the doubled weight
    new = copy.deepcopy(live)
    x, y = torch.randn(5, 3), torch.randn(6, 3)
    output(stash.run(0, x)).sum().backward()
    output(stash.run(1, y)).sum().backward()
    old(x).sum().backward()
    new(y).sum().backward()
    assert all(p.grad is None for p in live.parameters())
    stash.load_gradients()
    for (name, parameter), a, b in zip(live.named_parameters(), old.parameters(), new.parameters()):
        torch.testing.assert_close(grad(parameter), grad(a) + grad(b), msg=name)
    # moved, not copied: the versions hold no gradients any more
    assert all(t.grad is None for weights in stash.versions.values() for t in weights.values())
    assert [t is w for t, w in zip(stash.trainable(1), stash.versions[1].values())] == [True] * 6


def test_keep_only_drops_what_no_later_action_needs_but_the_newest() -> None:
    stash = WeightStash(model())
    for _ in range(3):
        stash.advance()
    assert sorted(stash.versions) == [0, 1, 2, 3]
    stash.keep_only([1])
    assert sorted(stash.versions) == [1, 3]
    with pytest.raises(RuntimeError, match=r"version 0 is no longer stashed \(kept: \[1, 3\]\)"):
        stash.run(0, torch.randn(2, 3))


def test_reset_makes_loaded_weights_the_only_version() -> None:
    live = model()
    stash = WeightStash(live)
    stash.advance()
    live.load_state_dict(model(seed=7).state_dict())
    stash.reset()
    assert sorted(stash.versions) == [1] and stash.newest == 1
    x = torch.randn(4, 3)
    torch.testing.assert_close(output(stash.run(1, x)), model(seed=7)(x))


def test_a_synchronous_step_waits_for_every_stage_the_rank_holds() -> None:
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    reference = [copy.deepcopy(first), copy.deepcopy(second)]
    optimizer = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.5)
    weights = Weights({0: first, 2: second}, optimizer, asynchronous=False)
    weights.begin([Action(Kind.STEP, 0), Action(Kind.STEP, 2)])
    for module in (first, second, *reference):
        module(torch.ones(1, 2)).sum().backward()
    weights.step(0)
    torch.testing.assert_close(first.weight, reference[0].weight)  # not yet
    weights.step(2)
    for module, expected in zip((first, second), reference):
        sgd_step(expected)
        torch.testing.assert_close(module.weight, expected.weight)
    assert weights.holders(2, None) == list(second.parameters())


def test_an_asynchronous_step_updates_at_once_and_keeps_the_versions_later_actions_use() -> None:
    live = nn.Linear(2, 1)
    reference = copy.deepcopy(live)
    weights = Weights({0: live}, torch.optim.SGD(live.parameters(), lr=0.5), asynchronous=True)
    # a window of pipedream's stage 0: F0 F1 on version 0, then B0 STEP, F2 on 1, B1 STEP, B2 STEP
    lane = [
        Action(Kind.FORWARD, 0, 0, version=0),
        Action(Kind.FORWARD, 0, 1, version=0),
        Action(Kind.BACKWARD, 0, 0, version=0),
        Action(Kind.STEP, 0, version=1),
        Action(Kind.FORWARD, 0, 2, version=1),
        Action(Kind.BACKWARD, 0, 1, version=0),
        Action(Kind.STEP, 0, version=2),
        Action(Kind.BACKWARD, 0, 2, version=1),
        Action(Kind.STEP, 0, version=3),
    ]
    weights.begin(lane)
    inputs = [torch.full((1, 2), float(k + 1)) for k in range(3)]
    versions = [copy.deepcopy(reference)]
    outputs: dict[int, torch.Tensor] = {}
    pending: list[torch.Tensor] = []
    kept = []
    for action in lane:
        mb, scheduled = action.microbatch, action.version
        if action.kind is Kind.FORWARD:
            assert mb is not None
            version = weights.version(0, scheduled)
            outputs[mb] = output(weights.run(0, version, (inputs[mb],)))
            assert version == scheduled  # the first window counts from version 0
        elif action.kind is Kind.BACKWARD:
            assert mb is not None and scheduled is not None
            outputs.pop(mb).sum().backward()
            used = versions[scheduled]
            loss = used(inputs[mb]).sum()
            pending = list(torch.autograd.grad(loss, list(used.parameters())))
        else:
            weights.step(0)
            stepped = copy.deepcopy(versions[-1])
            with torch.no_grad():
                for parameter, gradient in zip(stepped.parameters(), pending):
                    parameter.sub_(0.5 * gradient)
            versions.append(stepped)
            kept.append(sorted(weights.stashes[0].versions))
            assert all(p.grad is None for p in live.parameters())
    # each update keeps the versions later actions use, and the newest
    assert kept == [[0, 1], [1, 2], [3]]
    # live holds version 3's weights
    torch.testing.assert_close(live.weight, versions[3].weight)
    torch.testing.assert_close(live.bias, versions[3].bias)
    # the next window's versions count from there
    weights.begin([Action(Kind.FORWARD, 0, 0, version=0)])
    assert weights.version(0, 0) == 3 and weights.version(0, None) is None
    assert weights.holders(0, None) == weights.stashes[0].trainable(3)
