"""The split backward's two passes against one whole backward: the same gradients for the
inputs and every weight, and no activation gradient computed twice."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_simulate import held_until_weight_pass
from torch import nn

from pipetrain.app.models import build_model
from pipetrain.runtime.rank.executor import whole_backwards
from pipetrain.runtime.rank.split_backward import input_pass
from pipetrain.schedules import Kind, Schedule, build
from pipetrain.simulation import Costs, simulate


class Counted(torch.autograd.Function):
    """The identity, counting its backward calls."""

    calls = 0

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        Counted.calls += 1
        return grad


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(6, 5), nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(Counted.apply(torch.tanh(self.first(x))))


class UsedTwice(nn.Module):
    """One weight at two depths of the input path (tied within the stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared, self.middle = nn.Linear(5, 5), nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(torch.relu(self.middle(self.shared(x))))


class WeightOnlyOutput(nn.Module):
    """A second output that no input reaches, and the input passed through."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.scale = nn.Linear(5, 5), nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x) * self.scale.sum(), self.scale * 2.0, x


class Scale(torch.autograd.Function):
    """``x * w`` as a custom function: a branch point the weight pass cannot call itself."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(0)


class CustomBranch(nn.Module):
    """A weight whose gradient branches off the input path inside a custom function."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.scale = nn.Linear(5, 5), nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(Scale.apply(torch.tanh(x), self.scale))


class NoGradient(torch.autograd.Function):
    """The identity, whose backward sends no gradient back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> None:  # type: ignore[override]
        return None


class CutBranch(nn.Module):
    """The one branch point, on the input path, reached by the backward with no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.cut = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NoGradient.apply(self.cut(x)) + 2 * x


class Autocast(nn.Module):
    """``inner`` under CPU bfloat16 autocast: weights reach their matmuls through casts."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(x).float()


def split_and_whole(
    module: nn.Module, make_inputs: Callable[[], tuple[torch.Tensor, ...]]
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Every gradient (inputs first, then weights) from the two passes and from one backward."""
    weights = list(module.parameters())
    results = []
    for split in (True, False):
        module.zero_grad(set_to_none=True)
        inputs = tuple(t.requires_grad_(t.is_floating_point()) for t in make_inputs())
        outputs = module(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        grads = tuple(torch.randn(o.shape, generator=torch.Generator().manual_seed(i))
                      for i, o in enumerate(outputs))  # fmt: skip
        leaves = [t for t in inputs if t.requires_grad]
        if split:
            input_grads, weight_pass = input_pass(outputs, grads, leaves, weights)
            del outputs  # the weight pass needs nothing the caller keeps
            weight_pass.run()
        else:
            torch.autograd.backward(outputs, grads)
            input_grads = tuple(t.grad for t in leaves)
        results.append([*input_grads, *(w.grad for w in weights)])
    return results[0], results[1]


def assert_same(split: list[torch.Tensor | None], whole: list[torch.Tensor | None]) -> None:
    assert len(split) == len(whole)
    for index, (a, b) in enumerate(zip(split, whole)):
        assert (a is None) == (b is None), f"gradient {index}: {a} against {b}"
        if a is not None and b is not None:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"gradient {index}")


def seeded(*shape: int) -> Callable[[], tuple[torch.Tensor, ...]]:
    return lambda: (torch.randn(*shape, generator=torch.Generator().manual_seed(7)),)


def test_the_weight_pass_recomputes_no_activation_gradient() -> None:
    torch.manual_seed(0)
    module = TwoLinears()
    Counted.calls = 0
    split, whole = split_and_whole(module, seeded(3, 6))
    assert_same(split, whole)
    # one backward call in the two passes, one in the whole backward
    assert Counted.calls == 2


@pytest.mark.parametrize(
    ("module", "make_inputs"),
    [
        (UsedTwice(), seeded(3, 5)),
        (WeightOnlyOutput(), seeded(2, 5)),
        (CustomBranch(), seeded(3, 5)),
        (Autocast(build_model("gpt")[2]), seeded(2, 16, 64)),
        (build_model("gpt")[2], seeded(2, 16, 64)),  # a transformer block
        (
            build_model("gpt")[:2],  # embeddings: no input gradient
            lambda: (torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3)),),
        ),
    ],
    ids=[
        "weight-used-twice",
        "weight-only-output",
        "custom-function-branch",
        "bf16-autocast-block",
        "gpt-block",
        "embedding",
    ],
)
def test_two_passes_give_every_gradient_one_backward_gives(
    module: nn.Module, make_inputs: Callable[[], tuple[torch.Tensor, ...]]
) -> None:
    torch.manual_seed(0)
    split, whole = split_and_whole(module, make_inputs)
    assert_same(split, whole)
    assert all(g is not None for g in split[-len(list(module.parameters())) :])


def test_a_branch_point_reached_without_gradient_gives_its_weights_none() -> None:
    torch.manual_seed(0)
    split, whole = split_and_whole(CutBranch(), seeded(3, 5))
    assert_same(split, whole)
    assert split[0] is not None and split[1:] == [None, None]  # the input's; cut's


def test_a_weight_pass_right_after_its_backward_runs_with_it() -> None:
    lane = Schedule.from_text(
        "rank 0: F0.0 F1.0 F0.1 F1.1 B1.0 W1.0 B0.0 B1.1 W0.0 W1.1 B0.1 W0.1 STEP0 STEP1"
    ).ranks[0]
    # B1.1 W0.0: another micro-batch's W; W1.1 after W0.0: not right after its B
    assert whole_backwards(lane) == {(1, 0), (0, 1)}


@pytest.mark.parametrize("p, groups", [(2, 2), (2, 4), (3, 2), (4, 2)])
def test_dualpipev_full_backwards_send_after_their_weight_pass(p: int, groups: int) -> None:
    full, split = (build("dualpipev", p, groups * p, full_backward=f) for f in (True, False))
    for rank in range(p):
        lane, written = full.ranks[rank], split.ranks[rank]
        # the same actions, each full backward's gradient sent after its W
        assert sorted(map(str, lane)) == sorted(map(str, written))
        for index, action in enumerate(lane):
            if action.kind is Kind.SEND_B:
                producer = lane[index - 1]
                assert producer.kind in (Kind.BACKWARD, Kind.WEIGHT)
                assert producer[1:3] == action[1:3]
        fused = whole_backwards(lane)
        assert fused >= whole_backwards(written)
        sends_after_weight = {
            (a.stage, a.microbatch)
            for a, previous in zip(lane[1:], lane)
            if a.kind is Kind.SEND_B and previous.kind is Kind.WEIGHT
        }
        assert sends_after_weight <= fused
    # memory as before: PP + 1 chunk micro-batches held until their W
    costs = Costs(forward_s=1.0, backward_s=1.0, weight_s=1.0)
    assert held_until_weight_pass(simulate(full, costs)) == [2 * p + 1] * p
