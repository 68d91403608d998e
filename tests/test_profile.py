"""Profiles validate, round-trip through JSON and rescale; profile() measures without side
effects."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace

import pytest
import torch
from torch import Tensor, nn

from pipetrain.profiler import LayerCost, Profile, Spread, pooled, profile
from pipetrain.profiler.timing import Timer, time_weight_version

# ---- the Profile type ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "field",
    [
        "forward_s",
        "backward_s",
        "activation_bytes",
        "parameter_bytes",
        "optimizer_bytes",
        "peak_memory_bytes",
        "saved_bytes",
    ],
)
def test_negative_values_name_the_layer_and_field(field: str) -> None:
    bad = LayerCost(forward_s=1.0, backward_s=1.0, name="head")
    setattr(bad, field, -1.0)
    message = rf"layer 1 \(head\): {field} must be a finite number >= 0, got -1.0"
    with pytest.raises(ValueError, match=message):
        Profile([LayerCost(1.0, 1.0), bad])


def test_other_invalid_profiles() -> None:
    with pytest.raises(ValueError, match="non-empty list"):
        Profile([])
    with pytest.raises(
        ValueError, match="layer 0: forward_s must be a finite number >= 0, got nan"
    ):
        Profile([LayerCost(float("nan"), 1.0)])
    with pytest.raises(ValueError, match=r"weight_backward_s = 3\.0 exceeds backward_s"):
        Profile([LayerCost(1.0, 2.0, weight_backward_s=3.0)])
    with pytest.raises(ValueError, match="microbatch_size"):
        Profile([LayerCost(1.0, 2.0)], microbatch_size=0)
    with pytest.raises(TypeError, match="LayerCost"):
        Profile([(1.0, 2.0)])  # type: ignore[list-item]


def sample_profile() -> Profile:
    return Profile(
        [
            LayerCost(0.5, 1.0, 400.0, 1000.0, 0.25, 2000.0, 1500.0, "embed"),
            LayerCost(1.5, 3.0, 800.0, 0.0, None, 0.0, 800.0, "act"),
        ],
        microbatch_size=4,
        input_bytes=64.0,
    )


def test_json_round_trip(tmp_path) -> None:
    path = tmp_path / "profile.json"
    original = sample_profile()
    original.save(path)
    assert json.loads(path.read_text())["format_version"] == 1
    assert Profile.load(path) == original


def test_message_costs_round_trip_and_older_profiles_load_without_them(tmp_path) -> None:
    path = tmp_path / "profile.json"
    measured = replace(
        sample_profile(),
        message_s=2e-4,
        send_byte_s=5e-10,
        receive_byte_s=2e-10,
        weight_version_byte_s=1e-10,
        shared_cores_factor=1.1,
    )
    measured.save(path)
    loaded = Profile.load(path)
    assert (loaded.message_s, loaded.send_byte_s, loaded.receive_byte_s) == (2e-4, 5e-10, 2e-10)
    assert loaded.weight_version_byte_s == 1e-10 == loaded.scaled(8).weight_version_byte_s
    assert loaded.shared_cores_factor == 1.1 == loaded.scaled(8).shared_cores_factor
    # a message's costs are per message and per byte: the micro-batch size leaves them
    doubled = loaded.scaled(8)
    assert (doubled.message_s, doubled.send_byte_s, doubled.receive_byte_s) == (
        2e-4, 5e-10, 2e-10,
    )  # fmt: skip
    # a profile saved before the per-byte costs were measured loads without them
    data = measured.to_dict()
    del data["send_byte_s"], data["receive_byte_s"], data["weight_version_byte_s"]
    del data["shared_cores_factor"]
    older = Profile.from_dict(data)
    assert (older.message_s, older.send_byte_s, older.receive_byte_s) == (2e-4, 0.0, 0.0)
    assert (older.weight_version_byte_s, older.shared_cores_factor) == (0.0, 1.0)
    with pytest.raises(ValueError, match=r"Profile\.send_byte_s"):
        replace(measured, send_byte_s=-1.0)
    with pytest.raises(ValueError, match=r"shared_cores_factor = 0\.9 is below 1"):
        replace(measured, shared_cores_factor=0.9)


def test_unknown_format_versions_are_rejected(tmp_path) -> None:
    data = sample_profile().to_dict()
    for version in (None, 0, 2, "1"):
        data["format_version"] = version
        with pytest.raises(ValueError, match=f"format_version {version!r} is not supported"):
            Profile.from_dict(data)
    data["format_version"] = 1
    data["layers"][0]["colour"] = "red"
    with pytest.raises(ValueError, match="unknown fields"):
        Profile.from_dict(data)


def with_spread() -> Profile:
    """The sample profile with two measured runs."""
    return Profile(
        sample_profile().layers,
        microbatch_size=4,
        spread=Spread([[0.5, 1.5], [1.0, 2.0]], [[1.0, 3.0], [2.0, 3.5]]),
    )


def test_spread_round_trips_and_scales(tmp_path) -> None:
    path = tmp_path / "profile.json"
    with_spread().save(path)
    assert Profile.load(path) == with_spread()
    doubled = with_spread().scaled(8).spread
    assert doubled == Spread([[1.0, 3.0], [2.0, 4.0]], [[2.0, 6.0], [4.0, 7.0]])
    # a profile saved without runs loads without them
    data = sample_profile().to_dict()
    del data["spread"]
    assert Profile.from_dict(data).spread is None


def test_spread_is_checked() -> None:
    layers = sample_profile().layers
    with pytest.raises(ValueError, match="run 1 must list 2 layer times"):
        Profile(layers, spread=Spread([[1.0, 1.0], [1.0]], [[1.0, 1.0]]))
    with pytest.raises(ValueError, match=r"Spread\.backward_s must be a non-empty list"):
        Profile(layers, spread=Spread([[1.0, 1.0]], []))
    with pytest.raises(ValueError, match="Spread run 0: forward_s must be a finite number >= 0"):
        Profile(layers, spread=Spread([[-1.0, 1.0]], [[1.0, 1.0]]))
    with pytest.raises(TypeError, match=r"Profile\.spread must be a Spread"):
        Profile(layers, spread={"forward_s": [[1.0, 1.0]]})  # type: ignore[arg-type]
    data = with_spread().to_dict()
    data["spread"]["colour"] = "red"
    with pytest.raises(ValueError, match="spread must be an object with forward_s and backward_s"):
        Profile.from_dict(data)


def test_stage_factors_by_hand() -> None:
    spread = with_spread().spread
    # layers 0..1 sum to 2.0 and 3.0 in the forward runs, 4.0 and 5.5 in the backward runs
    assert spread.stage_factors(0, 2, (2.0, 4.0)) == ([1.0, 1.5], [1.0, 5.5 / 4.0])
    assert spread.stage_factors(1, 2, (0.0, 3.0)) == ([1.0, 1.0], [1.0, 3.5 / 3.0])


def test_pooled_profiles_by_hand() -> None:
    slower = Profile(
        [
            LayerCost(1.5, 2.0, 400.0, 1000.0, 0.75, 2000.0, 1500.0, "embed", optimizer_s=0.5),
            LayerCost(2.5, 4.0, 800.0, 0.0, 1.0, 0.0, 800.0, "act"),
        ],
        microbatch_size=4,
        spread=Spread([[2.0, 3.0]], [[3.0, 4.0]]),
    )
    both = pooled([with_spread(), slower])
    first, second = both.layers
    assert (first.forward_s, first.backward_s, first.weight_backward_s, first.optimizer_s) == (
        1.0,
        1.5,
        0.5,
        0.25,
    )
    assert (first.activation_bytes, first.parameter_bytes, first.name) == (400.0, 1000.0, "embed")
    # one profile did not measure the second layer's weight share, so the pool has none
    assert (second.forward_s, second.backward_s, second.weight_backward_s) == (2.0, 3.5, None)
    # every worker's runs are kept
    assert both.spread == Spread(
        [[0.5, 1.5], [1.0, 2.0], [2.0, 3.0]], [[1.0, 3.0], [2.0, 3.5], [3.0, 4.0]]
    )
    assert pooled([with_spread(), sample_profile()]).spread is None
    assert pooled([sample_profile()]) == sample_profile()


def test_pooling_different_models_is_refused() -> None:
    with pytest.raises(
        ValueError, match="profile 1 has 2 layers at micro-batch size 8, profile 0 has 2 at 4"
    ):
        pooled([sample_profile(), sample_profile().scaled(8)])
    with pytest.raises(ValueError, match="at least one profile"):
        pooled([])


def test_scaled_by_hand() -> None:
    double = sample_profile().scaled(8)
    assert double.microbatch_size == 8 and double.input_bytes == 128.0
    first, second = double.layers
    assert (first.forward_s, first.backward_s, first.weight_backward_s) == (1.0, 2.0, 0.5)
    assert (first.activation_bytes, first.parameter_bytes, first.optimizer_bytes) == (
        800.0,
        1000.0,
        2000.0,
    )
    assert first.peak_memory_bytes == 1000.0 + 2 * 500.0
    assert second.weight_backward_s is None and second.peak_memory_bytes == 1600.0
    assert sample_profile().scaled(4) == sample_profile()


def test_scaled_starts_from_the_nearest_measured_size() -> None:
    # measured at 4 and at 16, where a sample costs less: every size scales from the nearer
    at_16 = Profile([LayerCost(2.0, 3.0), LayerCost(1.0, 1.0)], microbatch_size=16)
    both = replace(sample_profile(), other_sizes=(at_16,))
    assert both.scaled(16).layers == at_16.layers
    assert [layer.forward_s for layer in both.scaled(32).layers] == [4.0, 2.0]  # from 16
    assert [layer.forward_s for layer in both.scaled(2).layers] == [0.25, 0.75]  # from 4
    assert both.scaled(4) == both  # the measured size itself, nothing scaled
    # a scaled profile keeps the measured sizes, so that scaling it again stays exact
    assert both.scaled(32).scaled(16).layers == at_16.layers
    again = Profile.from_dict(json.loads(json.dumps(both.to_dict())))
    assert again == both
    assert pooled([both, both]).other_sizes == (at_16,)
    with pytest.raises(ValueError, match="measured at 1 other sizes, profile 0 at 0"):
        pooled([sample_profile(), both])
    with pytest.raises(ValueError, match="give each size once"):
        replace(sample_profile(), other_sizes=(sample_profile(),))


def test_weight_share_defaults_to_half_the_backward() -> None:
    assert LayerCost(1.0, 3.0).weight_share_s == 1.5
    assert LayerCost(1.0, 3.0, weight_backward_s=1.0).weight_share_s == 1.0


# ---- measuring ----------------------------------------------------------------------------


def model_with_batchnorm() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 3)
    )


def snapshot(model: nn.Module) -> dict[str, object]:
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "grads": {
            k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()
        },
        "modes": [m.training for m in model.modules()],
        "devices": {p.device for p in model.parameters()},
        "identity": [id(p) for p in model.parameters()],
    }


def assert_same(before: dict, after: dict) -> None:
    assert before["modes"] == after["modes"]
    assert before["devices"] == after["devices"]
    assert before["identity"] == after["identity"]
    assert before["state"].keys() == after["state"].keys()
    for key, value in before["state"].items():
        assert torch.equal(value, after["state"][key]), key
    for key, grad in before["grads"].items():
        if grad is None:
            assert after["grads"][key] is None, key
        else:
            assert torch.equal(grad, after["grads"][key]), key


@pytest.mark.parametrize("train", [True, False])
def test_profile_leaves_the_model_unchanged(train: bool) -> None:
    model = model_with_batchnorm().train(train)
    model[0].weight.grad = torch.full_like(
        model[0].weight, 0.5
    )  # an existing gradient must survive
    inputs, targets = torch.randn(16, 6), torch.randint(0, 3, (16,))
    before = snapshot(model)
    rng_before = torch.random.get_rng_state()
    profile(model, inputs, targets, nn.CrossEntropyLoss(), repeats=2, warmup=1)
    assert_same(before, snapshot(model))
    assert torch.equal(rng_before, torch.random.get_rng_state())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_profile_on_a_gpu_measures_memory_and_leaves_the_model_there() -> None:
    model = model_with_batchnorm().cuda()
    inputs, targets = (
        torch.randn(64, 6),
        torch.randint(0, 3, (64,)),
    )  # on the host: profile moves them
    before = snapshot(model)
    cuda_rng_before = torch.cuda.get_rng_state()
    result = profile(
        model, inputs, targets, nn.CrossEntropyLoss(), device="cuda", repeats=3, warmup=1
    )
    assert_same(before, snapshot(model))
    assert before["devices"] == {torch.device("cuda", 0)}
    assert torch.equal(cuda_rng_before, torch.cuda.get_rng_state())
    for layer in result.layers:
        assert layer.forward_s > 0 and layer.backward_s > 0
        # the allocator's own high-water mark: at least the layer's output is held
        assert layer.peak_memory_bytes >= layer.activation_bytes > 0


def test_profile_measures_a_small_sequential() -> None:
    model = model_with_batchnorm()
    result = profile(
        model,
        torch.randn(16, 6),
        torch.randint(0, 3, (16,)),
        nn.CrossEntropyLoss(),
        microbatch_size=4,
        repeats=3,
    )
    assert result.microbatch_size == 4
    assert result.input_bytes == 4 * 6 * 4
    assert [layer.name for layer in result.layers] == ["0", "1", "2", "3", "4"]
    assert [layer.parameter_bytes for layer in result.layers] == [
        4 * (6 * 8 + 8),
        4 * 16,
        0,
        0,
        4 * (8 * 3 + 3),
    ]
    assert [layer.optimizer_bytes for layer in result.layers] == [
        2 * 4 * 56,
        2 * 4 * 16,
        0,
        0,
        2 * 4 * 27,
    ]
    assert [layer.activation_bytes for layer in result.layers] == [4 * 4 * 8] * 4 + [4 * 4 * 3]
    for layer in result.layers:
        assert layer.forward_s > 0 and layer.backward_s > 0
        assert 0 <= layer.weight_backward_s <= layer.backward_s
        assert layer.peak_memory_bytes == layer.activation_bytes + layer.parameter_bytes
    assert result.layers[2].weight_backward_s == 0.0  # ReLU has no weights
    # copying a weight version and taking its norm: under a microsecond a byte
    assert 0 < result.weight_version_byte_s < 1e-6
    # every timed run is kept, on the scale of the medians
    assert len(result.spread.forward_s) == len(result.spread.backward_s) == 3
    for index, layer in enumerate(result.layers):
        assert statistics.median(run[index] for run in result.spread.forward_s) == pytest.approx(
            layer.forward_s
        )
        assert statistics.median(run[index] for run in result.spread.backward_s) == pytest.approx(
            layer.backward_s
        )


def test_the_optimizer_steps_all_weights_on_fresh_gradients() -> None:
    model = model_with_batchnorm()
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    made: list[int] = []
    gradients_seen: list[bool] = []

    class Recording(torch.optim.SGD):
        def step(self, closure=None):  # type: ignore[override]
            gradients_seen.append(
                all(p.grad is not None for group in self.param_groups for p in group["params"])
            )
            return super().step(closure)

    def factory(parameters: list[Tensor]) -> torch.optim.Optimizer:
        made.append(len(parameters))
        return Recording(parameters, lr=0.1)

    before = snapshot(model)
    result = profile(
        model,
        torch.randn(8, 6),
        torch.randint(0, 3, (8,)),
        nn.CrossEntropyLoss(),
        repeats=3,
        warmup=1,
        optimizer=factory,
    )
    # one optimizer over the whole model (timed as a stage steps), one per layer with weights
    assert made == [trainable, 2, 2, 2]
    # every run steps the whole model and each layer once, always with gradients present
    assert len(gradients_seen) == 4 * (1 + 3) and all(gradients_seen)
    assert [layer.optimizer_s > 0 for layer in result.layers] == [True, True, False, False, True]
    assert_same(before, snapshot(model))


class Split(nn.Module):
    """Returns a tuple, which the next layer receives unpacked."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x[:, :2], x[:, 2:]


class Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, left: Tensor, right: Tensor) -> Tensor:
        return self.scale * torch.cat([left, right], dim=1)


def test_tuple_outputs_and_integer_inputs() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), Split(), Join(), nn.Linear(12, 2))
    tokens = torch.randint(0, 10, (5, 3))
    result = profile(model, tokens, torch.randn(5, 2), nn.MSELoss(), repeats=1, warmup=0)
    embedding, _, split, join, _ = result.layers
    assert embedding.weight_backward_s == embedding.backward_s  # token ids carry no gradient
    assert split.activation_bytes == 4 * 5 * 12
    assert join.parameter_bytes == 4
    assert result.input_bytes == 8 * 5 * 3


def test_argument_errors() -> None:
    model = model_with_batchnorm()
    inputs, targets, loss = torch.randn(4, 6), torch.randint(0, 3, (4,)), nn.CrossEntropyLoss()
    with pytest.raises(ValueError, match="microbatch_size 5"):
        profile(model, inputs, targets, loss, microbatch_size=5)
    with pytest.raises(ValueError, match="repeats"):
        profile(model, inputs, targets, loss, repeats=0)
    with pytest.raises(ValueError, match="warmup"):
        profile(model, inputs, targets, loss, warmup=-1)
    with pytest.raises(ValueError, match="optimizer_state_factor"):
        profile(model, inputs, targets, loss, optimizer_state_factor=-1.0)
    with pytest.raises(ValueError, match="fewer than 2 rows"):
        profile(nn.Linear(6, 3), inputs[:1], targets[:1], loss)


def test_a_module_without_blocks_is_captured_as_one_layer() -> None:
    inputs, targets, loss = torch.randn(4, 6), torch.randint(0, 3, (4,)), nn.CrossEntropyLoss()
    measured = profile(nn.Linear(6, 3), inputs, targets, loss, repeats=1, warmup=0)
    assert [layer.name for layer in measured.layers] == ["model"]
    assert measured.layers[0].parameter_bytes == (6 * 3 + 3) * 4


def test_in_place_layers_can_be_profiled() -> None:
    model = nn.Sequential(
        nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2), nn.ReLU(inplace=True)
    )
    result = profile(model, torch.randn(8, 4), torch.randn(8, 2), nn.MSELoss(), repeats=1, warmup=0)
    assert all(layer.backward_s > 0 for layer in result.layers)


class SineOfLinear(nn.Module):
    """sin(Linear(x)): autograd keeps the Linear's output (sin's input) and the output."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 8)

    def forward(self, x: Tensor) -> Tensor:
        return torch.sin(self.linear(x))


def test_saved_bytes_count_what_autograd_keeps_beyond_inputs_and_weights() -> None:
    torch.manual_seed(0)
    layers = [SineOfLinear(), nn.Linear(8, 2)]
    result = profile(
        layers, torch.randn(3, 4), torch.randn(3, 2), nn.functional.mse_loss, repeats=1, warmup=0
    )
    # the Linear's output and sin's output (3 x 8 floats each); the input and weights,
    # which Linear saves too, are not the layer's to keep
    assert result.layers[0].saved_bytes == 2 * 3 * 8 * 4
    assert result.layers[0].activation_bytes == 3 * 8 * 4
    # the last layer: its output and the targets, both of which mse_loss keeps
    assert result.layers[1].saved_bytes == 2 * 3 * 2 * 4


def test_a_model_without_trainable_weights_has_no_weight_version_to_copy() -> None:
    assert time_weight_version([], Timer(torch.device("cpu")), repeats=2, warmup=1) == 0.0
    frozen = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3)).requires_grad_(False)
    measured = profile(
        frozen, torch.randn(8, 6), torch.randint(0, 3, (8,)), nn.CrossEntropyLoss(), repeats=2
    )
    assert measured.weight_version_byte_s == 0.0
