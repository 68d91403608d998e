"""The built-in models: shapes, losses, determinism, and that they learn on their data."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pipetrain.app.data import BatchStream
from pipetrain.app.model_registry import model_spec
from pipetrain.app.models import MODEL_NAMES, build_model, loss_function, model_layers
from pipetrain.model.layers import to_layers

OUTPUT_SHAPES = {
    "mlp": (16, 10),
    "cnn": (16, 10),
    "uneven-mlp": (16, 10),
    "vgg": (16, 10),
    "gpt": (16, 64, 256),
    "hf-gpt2": (16, 64, 256),
    "hf-llama": (16, 64, 256),
}


def test_every_model_name_has_expected_output() -> None:
    assert set(MODEL_NAMES) == set(OUTPUT_SHAPES)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_output_shape_and_finite_loss(name: str) -> None:
    model = build_model(name)
    inputs, targets = next(BatchStream(name, 16))
    outputs = model(inputs)
    logits = outputs if isinstance(outputs, torch.Tensor) else outputs.logits
    assert logits.shape == OUTPUT_SHAPES[name]
    loss = loss_function(name)(outputs, targets)
    assert loss.shape == () and math.isfinite(loss.item())
    # the registry says how many layers a pipeline cuts the model into, without building it
    assert model_layers(name) == model_spec(name).layers >= 4


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_training_lowers_held_out_loss(name: str) -> None:
    model = build_model(name, seed=1)
    loss_fn = loss_function(name)
    stream = BatchStream(name, 32, seed=1)
    eval_inputs, eval_targets = stream.eval_set()
    with torch.no_grad():
        before = loss_fn(model(eval_inputs), eval_targets).item()
    optimizer = torch.optim.Adam(model.parameters(), lr=model_spec(name).lr)
    for _ in range(30):
        inputs, targets = next(stream)
        optimizer.zero_grad()
        loss_fn(model(inputs), targets).backward()
        optimizer.step()
    with torch.no_grad():
        after = loss_fn(model(eval_inputs), eval_targets).item()
    assert after < 0.7 * before, (before, after)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_seed_determines_initial_weights(name: str) -> None:
    first, again, other = (build_model(name, seed=seed) for seed in (3, 3, 4))
    first_state, other_state = first.state_dict(), other.state_dict()
    for key, value in again.state_dict().items():
        assert torch.equal(value, first_state[key]), key
    assert any(not torch.equal(v, other_state[k]) for k, v in first_state.items())


def test_build_leaves_global_random_state_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model("mlp", seed=9)
    assert torch.equal(torch.rand(3), expected)


def test_unknown_model_lists_names() -> None:
    with pytest.raises(ValueError, match=r"unknown model 'resnet'.*mlp, cnn, gpt, uneven-mlp"):
        build_model("resnet")
    with pytest.raises(ValueError, match="unknown model"):
        loss_function("resnet")


def test_unknown_option_lists_accepted_options() -> None:
    with pytest.raises(TypeError, match="no option width; its options are hidden, hidden_layers"):
        build_model("mlp", width=3)


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("mlp", {"hidden": 0}, "mlp hidden must be a positive integer, got 0"),
        ("cnn", {"channels": -1}, "cnn channels must be a positive integer, got -1"),
        ("gpt", {"n_layers": 0}, "gpt n_layers must be a positive integer, got 0"),
    ],
)
def test_bad_sizes_are_refused(name: str, options: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_model(name, **options)


def test_options_change_the_model() -> None:
    mlp = build_model("mlp", hidden=32, hidden_layers=3)
    assert len(mlp) == 7 and mlp[0].out_features == 32
    gpt = build_model("gpt", n_layers=2, d_model=32)
    assert len(gpt) == 4


def test_gpt_layers_are_embedding_blocks_head() -> None:
    gpt = build_model("gpt")
    kinds = [type(module).__name__ for _, module in to_layers(gpt)]
    assert kinds == ["Embedding", "Block", "Block", "Block", "Block", "Head"]


def test_gpt_is_causal() -> None:
    gpt = build_model("gpt").eval()
    tokens = torch.randint(0, 256, (2, 20))
    changed = tokens.clone()
    changed[:, 12:] = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        original, edited = gpt(tokens), gpt(changed)
    torch.testing.assert_close(original[:, :12], edited[:, :12])
    assert not torch.allclose(original[:, 12:], edited[:, 12:])


def test_gpt_loss_is_mean_token_cross_entropy() -> None:
    logits = torch.randn(2, 3, 256)
    targets = torch.randint(0, 256, (2, 3))
    by_hand = (
        -sum(
            torch.log_softmax(logits[b, t], dim=0)[targets[b, t]]
            for b in range(2)
            for t in range(3)
        )
        / 6
    )
    torch.testing.assert_close(loss_function("gpt")(logits, targets), by_hand)


def test_gpt_dropout_is_reproducible_from_the_random_seed() -> None:
    gpt = build_model("gpt", dropout=0.3)
    tokens = torch.randint(0, 256, (2, 16))
    torch.manual_seed(5)
    first = gpt(tokens)
    torch.manual_seed(5)
    again = gpt(tokens)
    other = gpt(tokens)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    gpt.eval()
    assert torch.equal(gpt(tokens), gpt(tokens))


def test_gpt_rejects_sequence_longer_than_context() -> None:
    gpt = build_model("gpt", context=8)
    with pytest.raises(ValueError, match="sequence length 9 exceeds the model's context 8"):
        gpt(torch.zeros(1, 9, dtype=torch.int64))


def linear_macs(module: nn.Module) -> int:
    """Multiply-accumulates per sample of the Linear layers inside ``module``."""
    return sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear))


def test_uneven_mlp_halves_have_very_different_compute() -> None:
    layers = to_layers(build_model("uneven-mlp"))
    half = len(layers) // 2
    first = sum(linear_macs(module) for _, module in layers[:half])
    second = sum(linear_macs(module) for _, module in layers[half:])
    assert second >= 10 * first
