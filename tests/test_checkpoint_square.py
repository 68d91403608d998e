"""A four-layer model saved on balance [2, 2] loads on [1, 3], on three stages and into the
unpipelined model with identical weights and optimizer state, and the next steps are the
unpipelined loop's; pipedream's weight versions go on across layouts as a one-process
replay of its rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import checkpoint_cases as cases
import pytest
import torch
from checkpoint_square_cases import THREE, WINDOW, four, pipedream_replay, square

import pipetrain
from pipetrain import checkpoint


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("square")


@pytest.fixture(scope="module")
def ranks(root: Path) -> list[dict[str, Any]]:
    return pipetrain.launch(square, 3, str(root), timeout_s=300)


@pytest.fixture(scope="module")
def exported(root: Path, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    checkpoint.export(root / "square", root / "square.pt")
    return torch.load(root / "square.pt", weights_only=False)


@pytest.mark.parametrize("layout", ["one_three", "three"])
def test_another_layout_loads_the_saved_weights_and_optimizer_state(
    ranks: list[dict[str, Any]], exported: dict[str, Any], layout: str
) -> None:
    runs = [rank[layout] for rank in ranks if layout in rank]
    assert len(runs) == (2 if layout == "one_three" else 3)
    assert exported["progress"]["step"] == cases.SAVED_AT
    assert set(exported["optimizer"]["state"]) == {n for n, _ in four().named_parameters()}
    cases.assert_loaded_as_exported(runs, exported)
    for run in runs:
        assert run["found"].layout["balance"] == [2, 2]
        assert run["updates"] == cases.SAVED_AT


@pytest.mark.parametrize("layout", ["one_three", "three"])
def test_another_layout_goes_on_as_the_unpipelined_loop(
    ranks: list[dict[str, Any]], layout: str
) -> None:
    reference = cases.reference_loop(four())
    runs = [rank[layout] for rank in ranks if layout in rank]
    for run in runs:
        assert run["losses"] == pytest.approx(reference["losses"][cases.SAVED_AT :], rel=1e-5)
    cases.assert_close_state(cases.merged(runs, "final"), reference["state"])


def test_the_unpipelined_model_loads_it_and_goes_on_as_the_uninterrupted_loop(
    root: Path, ranks: list[dict[str, Any]], exported: dict[str, Any]
) -> None:
    reference = cases.reference_loop(four())
    model = four(seed=5)
    resumed = cases.reference_loop(model, cases.SAVED_AT, path=root / "square")
    assert resumed["found"].step == cases.SAVED_AT
    assert resumed["losses"] == pytest.approx(reference["losses"][cases.SAVED_AT :], rel=1e-5)
    cases.assert_close_state(resumed["state"], reference["state"])


def test_pipedream_versions_go_on_on_three_stages_as_the_replay(
    ranks: list[dict[str, Any]], root: Path, tmp_path: Path
) -> None:
    checkpoint.export(root / "square-pipedream", tmp_path / "pd.pt")
    saved = torch.load(tmp_path / "pd.pt", weights_only=False)
    runs = [rank["pipedream"] for rank in ranks]
    cases.assert_equal_state(cases.merged(runs, "state"), saved["model"])
    for run in runs:  # an update per mini-batch numbers the versions
        assert run["found"] == run["updates"] == saved["progress"]["updates"] == WINDOW
        for newest, versions in run["versions"].values():
            assert (newest, versions) == (WINDOW, [WINDOW])
        assert run["after"] == 2 * WINDOW
    expected = pipedream_replay([[2, 2], THREE])
    cases.assert_close_state(cases.merged(runs, "final"), expected)
    continued_as_saved = pipedream_replay([[2, 2], [2, 2]])
    assert any(not torch.allclose(expected[n], continued_as_saved[n]) for n in expected), (
        "the replay must tell the layouts' version rules apart"
    )
