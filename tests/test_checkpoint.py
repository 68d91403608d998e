"""Saving and resuming: a checkpoint taken on one layout loads into others and into the
unpipelined model, and the next updates are those of an uninterrupted run; saving is
atomic; another model's checkpoint is refused, naming the difference."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import checkpoint_cases as cases
import pytest
import torch
from pipeline_cases import mlp
from torch import nn
from training_cases import adamw

import pipetrain
from pipetrain import checkpoint
from pipetrain.checkpoint.directory import METADATA, step_path, temporary_path


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def ranks(root: Path) -> list[dict[str, Any]]:
    return pipetrain.launch(cases.layouts, 3, str(root), timeout_s=300)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return cases.reference_loop(mlp())


@pytest.mark.parametrize("layout", ["three", "replicated"])
def test_a_checkpoint_of_two_stages_continues_on_another_layout_as_the_unpipelined_run(
    ranks: list[dict[str, Any]], reference: dict[str, Any], layout: str
) -> None:
    runs = [rank[layout] for rank in ranks]
    for run in runs:
        assert run["losses"] == pytest.approx(reference["losses"][cases.SAVED_AT :], rel=1e-5)
        assert run["updates"] == cases.SAVED_AT
        assert run["found"].step == cases.SAVED_AT and run["found"].extra == {"next": 2}
        assert run["found"].layout["balance"] == [2, 3]
        assert run["precision"] == cases.SCALER
    cases.assert_close_state(cases.merged(runs, "final"), reference["state"])


def test_the_unpipelined_model_loads_a_checkpoint_and_continues(
    root: Path, ranks: list[dict[str, Any]], reference: dict[str, Any]
) -> None:
    resumed = cases.reference_loop(mlp(seed=5), cases.SAVED_AT, path=root / "two")
    assert resumed["found"].path == step_path(root / "two", cases.SAVED_AT)
    assert resumed["losses"] == pytest.approx(reference["losses"][cases.SAVED_AT :], rel=1e-5)
    cases.assert_close_state(resumed["state"], reference["state"])


def test_every_layout_loads_the_same_weights_and_optimizer_state(
    root: Path, ranks: list[dict[str, Any]], tmp_path: Path
) -> None:
    out = tmp_path / "model.pt"
    checkpoint.export(root / "two", out)
    exported = torch.load(out, weights_only=False)
    for layout in ("three", "replicated"):
        cases.assert_loaded_as_exported([rank[layout] for rank in ranks], exported)
    names = {name for name, _ in mlp().named_parameters()}
    assert set(exported["optimizer"]["state"]) == names
    assert exported["progress"] == {"step": 2, "updates": 2, "skipped_updates": 0}
    assert exported["extra"] == {"next": 2}
    model = mlp(seed=5)
    model.load_state_dict(exported["model"])  # the export is a plain state dict


@pytest.mark.parametrize("schedule", ["same", "pipedream"])
def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(
    ranks: list[dict[str, Any]], schedule: str
) -> None:
    """Dropout included: each rank's random state is restored."""
    for rank in ranks[:2]:
        run = rank[schedule]
        expected = run["uninterrupted"]
        assert run["resumed"]["losses"] == expected["losses"][cases.SAVED_AT :]
        cases.assert_equal_state(run["resumed"]["final"], expected["final"])


def test_pipedream_weight_versions_resume_on_another_layout(
    root: Path, ranks: list[dict[str, Any]], tmp_path: Path
) -> None:
    checkpoint.export(root / "pipedream", tmp_path / "pd.pt")
    exported = torch.load(tmp_path / "pd.pt", weights_only=False)
    runs = [rank["pipedream_three"] for rank in ranks]
    cases.assert_equal_state(cases.merged(runs, "state"), exported["model"])
    updates = exported["progress"]["updates"]
    assert updates == 2 * cases.SAVED_AT  # pipedream: an update per mini-batch
    for run in runs:
        assert run["updates"] == updates
        for newest, versions in run["versions"].values():
            assert (newest, versions) == (updates, [updates])
        assert all(torch.isfinite(torch.tensor(run["losses"])))


def test_old_checkpoints_are_pruned(root: Path, ranks: list[dict[str, Any]]) -> None:
    assert [p.name for p in checkpoint.checkpoints(root / "two")] == ["step-00000002"]
    assert not [p for p in os.listdir(root / "two") if p.startswith(".")]


def test_another_models_checkpoint_is_refused_on_every_rank_naming_the_difference(
    ranks: list[dict[str, Any]],
) -> None:
    messages = {rank["refused"] for rank in ranks}
    assert len(messages) == 1, "every rank refuses alike"
    message = messages.pop()
    assert "0.weight has shape [12, 6] in the checkpoint but [16, 6] in the model" in message
    assert "3.weight has shape [12, 12] in the checkpoint but [12, 16] in the model" in message


def test_load_full_names_missing_unknown_and_reshaped_entries(
    root: Path, ranks: list[dict[str, Any]]
) -> None:
    path = root / "two"
    with pytest.raises(checkpoint.CheckpointMismatch, match=r"0.bias has shape \[12\] in the"):
        checkpoint.load_full(path, cases.wide())
    longer = nn.Sequential(*mlp(), nn.Linear(3, 3))
    with pytest.raises(checkpoint.CheckpointMismatch, match=r"5\.weight is not in the checkpoint"):
        checkpoint.load_full(path, longer)
    shorter = nn.Sequential(*list(mlp())[:4])
    with pytest.raises(checkpoint.CheckpointMismatch, match=r"holds 4\.bias, 4\.weight, which the"):
        checkpoint.load_full(path, shorter)
    model = mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(checkpoint.CheckpointMismatch, match="another kind of optimizer"):
        checkpoint.load_full(path, model, sgd)


def test_a_half_written_checkpoint_is_never_used(root: Path, ranks: list[dict[str, Any]]) -> None:
    path = root / "two"
    complete = checkpoint.latest(path)
    unfinished = temporary_path(path, 9)
    unfinished.mkdir()
    (unfinished / "__0_0.distcp").write_bytes(b"partial")
    renamed_without_metadata = step_path(path, 8)
    renamed_without_metadata.mkdir()
    assert checkpoint.latest(path) == complete
    model = mlp(seed=5)
    assert checkpoint.load_full(path, model, adamw(model.parameters())).step == cases.SAVED_AT
    assert not (renamed_without_metadata / METADATA).exists()
    renamed_without_metadata.rmdir()


def test_no_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    assert checkpoint.latest(tmp_path / "missing") is None
    with pytest.raises(FileNotFoundError, match="no complete checkpoint in"):
        checkpoint.load_full(tmp_path, mlp())
