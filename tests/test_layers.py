"""Stage modules built from layer ranges behave exactly like the full model."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from pipetrain.model.layers import (
    StageModule,
    build_stage,
    check_balance,
    stage_bounds,
    to_layers,
)


def small_model() -> nn.Sequential:
    """Six layers, one with buffers (BatchNorm) so state_dict keys include them."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 8), nn.ReLU(), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
    ).eval()


def run_chained(model: nn.Module, balance: list[int], inputs: Tensor) -> Tensor:
    """Feed ``inputs`` through the stages of ``balance`` one after another."""
    output = inputs
    for start, stop in stage_bounds(balance):
        output = build_stage(model, start, stop)(output)
    return output


def compositions(total: int) -> st.SearchStrategy[list[int]]:
    """Every way of writing ``total`` as an ordered sum of positive integers."""
    cuts = st.sets(st.integers(1, total - 1)).map(sorted)
    return cuts.map(lambda c: [b - a for a, b in zip([0, *c], [*c, total])])


@pytest.mark.parametrize("balance", [[6], [1, 5], [3, 3], [5, 1], [1, 1, 1, 1, 1, 1], [2, 1, 3]])
def test_chained_stages_equal_full_model(balance: list[int]) -> None:
    model = small_model()
    inputs = torch.randn(4, 5)
    assert torch.equal(run_chained(model, balance, inputs), model(inputs))


@settings(max_examples=50, deadline=None)
@given(balance=compositions(6))
def test_stage_keys_partition_full_model_keys(balance: list[int]) -> None:
    model = small_model()
    full_parameters = dict(model.named_parameters())
    seen_parameters: dict[str, Tensor] = {}
    seen_state: set[str] = set()
    for start, stop in stage_bounds(balance):
        stage = build_stage(model, start, stop)
        parameters = dict(stage.named_parameters())
        assert not parameters.keys() & seen_parameters.keys()
        seen_parameters.update(parameters)
        assert not stage.state_dict().keys() & seen_state
        seen_state |= stage.state_dict().keys()
    assert seen_parameters.keys() == full_parameters.keys()
    assert all(seen_parameters[k] is full_parameters[k] for k in full_parameters)
    assert seen_state == model.state_dict().keys()


def test_stage_keys_use_full_model_indices() -> None:
    stage = build_stage(small_model(), 2, 4)
    assert stage.layer_names == ["2", "3"]
    assert set(stage.state_dict()) == {
        "2.weight",
        "2.bias",
        "2.running_mean",
        "2.running_var",
        "2.num_batches_tracked",
        "3.weight",
        "3.bias",
    }


def test_load_state_dict_takes_full_model_keys() -> None:
    model = small_model()
    stage = build_stage(model, 3, 6)
    source = small_model()
    with torch.no_grad():
        for parameter in source.parameters():
            parameter.add_(1.0)
    subset = {k: v for k, v in source.state_dict().items() if k.split(".")[0] in {"3", "4", "5"}}
    stage.load_state_dict(subset)
    assert torch.equal(model[3].weight, source[3].weight)
    assert not torch.equal(model[0].weight, source[0].weight)


def test_chained_stage_gradients_equal_full_model() -> None:
    model, reference = small_model().train(), small_model().train()
    inputs = torch.randn(6, 5)
    reference(inputs).square().sum().backward()
    stages = [build_stage(model, start, stop) for start, stop in stage_bounds([2, 1, 3])]
    boundary_inputs, outputs = [], []
    activation = inputs
    for stage in stages:
        activation = activation.detach().requires_grad_()
        boundary_inputs.append(activation)
        activation = stage(activation)
        outputs.append(activation)
    outputs[-1].square().sum().backward()
    for index in range(len(stages) - 2, -1, -1):
        outputs[index].backward(boundary_inputs[index + 1].grad)
    expected = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, expected[name].grad, msg=name)


def test_sequential_with_custom_names() -> None:
    named = OrderedDict(encoder=nn.Linear(3, 4), act=nn.ReLU(), decoder=nn.Linear(4, 2))
    model = nn.Sequential(named)
    assert [name for name, _ in to_layers(model)] == ["encoder", "act", "decoder"]
    stage = build_stage(model, 1, 3)
    assert set(dict(stage.named_parameters())) == {"decoder.weight", "decoder.bias"}


def test_list_and_module_list_are_named_by_index() -> None:
    modules = [nn.Linear(2, 2), nn.ReLU()]
    assert [name for name, _ in to_layers(modules)] == ["0", "1"]
    assert [name for name, _ in to_layers(tuple(modules))] == ["0", "1"]
    assert [name for name, _ in to_layers(nn.ModuleList(modules))] == ["0", "1"]
    assert to_layers(modules)[0][1] is modules[0]


class TinyTransformer(nn.Module):
    """A model split at named blocks through ``pipeline_layers()``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.embed = nn.Embedding(10, 6)
        self.blocks = nn.ModuleList(
            nn.Sequential(OrderedDict(attn=nn.Linear(6, 6), act=nn.GELU())) for _ in range(3)
        )
        self.head = nn.Linear(6, 10)

    def pipeline_layers(self) -> list[tuple[str, nn.Module]]:
        blocks = [(f"blocks.{i}", block) for i, block in enumerate(self.blocks)]
        return [("embed", self.embed), *blocks, ("head", self.head)]

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("balance", [[5], [2, 3], [1, 1, 1, 1, 1], [1, 3, 1]])
def test_pipeline_layers_model_with_dotted_names(balance: list[int]) -> None:
    model = TinyTransformer()
    tokens = torch.randint(0, 10, (2, 7))
    assert torch.equal(run_chained(model, balance, tokens), model(tokens))
    keys: set[str] = set()
    for start, stop in stage_bounds(balance):
        keys |= build_stage(model, start, stop).state_dict().keys()
    assert keys == model.state_dict().keys()
    assert "blocks.1.attn.weight" in build_stage(model, 2, 3).state_dict()


class Split(nn.Module):
    """Returns two tensors."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x + 1, x * 2


class Join(nn.Module):
    """Takes two tensors."""

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return a - b


def test_tuple_outputs_are_unpacked_into_next_layer() -> None:
    stage = StageModule([("split", Split()), ("join", Join())])
    x = torch.tensor([1.0, 2.0])
    outputs = stage.forward_layers(x)
    assert torch.equal(outputs[0][0], x + 1) and torch.equal(outputs[0][1], x * 2)
    assert torch.equal(outputs[1], (x + 1) - x * 2)
    assert torch.equal(stage(x), torch.tensor([0.0, -1.0]))
    _, second = StageModule([("split", Split())])(x)
    assert torch.equal(second, x * 2)


class SplitList(nn.Module):
    """Returns two tensors as a list."""

    def forward(self, x: Tensor) -> list[Tensor]:
        return [x + 1, x * 2]


def test_list_outputs_are_returned_as_tuples_and_unpacked() -> None:
    stage = StageModule([("split", SplitList()), ("join", Join())])
    x = torch.tensor([1.0, 2.0])
    outputs = stage.forward_layers(x)
    assert isinstance(outputs[0], tuple) and len(outputs[0]) == 2
    assert torch.equal(outputs[1], (x + 1) - x * 2)


class ReturnsDict(nn.Module):
    """Returns a value a pipeline cannot send."""

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {"x": x}


def test_non_tensor_output_names_layer_and_type() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), ReturnsDict())
    with pytest.raises(TypeError, match=r"layer '2' returned a dict"):
        build_stage(model, 0, 3)(torch.randn(1, 2))


def test_tuple_with_non_tensor_is_rejected() -> None:
    class Mixed(nn.Module):
        def forward(self, x: Tensor) -> tuple[Tensor, int]:
            return x, 3

    with pytest.raises(TypeError, match=r"layer 'mix' returned a tuple of \(Tensor, int\)"):
        StageModule([("mix", Mixed())])(torch.ones(1))


def test_check_balance_accepts_exact_sum() -> None:
    assert check_balance((3, 3), 6) == [3, 3]


def test_check_balance_wrong_sum_names_both_numbers() -> None:
    with pytest.raises(ValueError, match=r"balance \[3, 2\] sums to 5 but the model has 6 layers"):
        check_balance([3, 2], 6)


@pytest.mark.parametrize(
    "balance, bad",
    [
        ([2, 0, 4], "0 at index 1"),
        ([-1, 7], "-1 at index 0"),
        ([2.5, 3.5], "2.5 at index 0"),
        ([True, 5], "True at index 0"),
    ],
)
def test_check_balance_bad_entry_names_entry_and_index(balance: list, bad: str) -> None:
    with pytest.raises(ValueError, match=bad):
        check_balance(balance, 6)


def test_check_balance_empty() -> None:
    with pytest.raises(ValueError, match="empty"):
        check_balance([], 0)


def test_stage_bounds() -> None:
    assert stage_bounds([2, 1, 3]) == [(0, 2), (2, 3), (3, 6)]


def test_unsupported_model_type_explains_how_to_wrap() -> None:
    with pytest.raises(TypeError, match=r"Linear.*nn.Sequential.*pipeline_layers\(\)"):
        to_layers(nn.Linear(2, 2))


def test_empty_model_is_rejected() -> None:
    with pytest.raises(ValueError, match="no layers"):
        to_layers(nn.Sequential())


def test_non_module_entry_is_rejected() -> None:
    with pytest.raises(TypeError, match=r"layer '1' is a builtin_function_or_method"):
        to_layers([nn.ReLU(), torch.relu])


def test_layer_name_nested_in_another_layer_is_rejected() -> None:
    with pytest.raises(ValueError, match="prefix"):
        StageModule([("blocks", nn.ReLU()), ("blocks.0", nn.ReLU())])
    with pytest.raises(ValueError, match="prefix"):
        StageModule([("blocks.0", nn.ReLU()), ("blocks", nn.ReLU())])


def test_duplicate_layer_names_are_rejected() -> None:
    class Twice(nn.Module):
        def pipeline_layers(self) -> list[tuple[str, nn.Module]]:
            return [("a", nn.ReLU()), ("a", nn.ReLU())]

    with pytest.raises(ValueError, match="'a' appears twice"):
        to_layers(Twice())


@pytest.mark.parametrize("start, stop", [(0, 0), (3, 2), (-1, 2), (0, 7)])
def test_build_stage_rejects_bad_range(start: int, stop: int) -> None:
    with pytest.raises(ValueError, match="layer range"):
        build_stage(small_model(), start, stop)
