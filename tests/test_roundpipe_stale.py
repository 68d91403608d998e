"""RoundPipe's one-step-stale variant (``stale=True``) trained by the runtime, against a
one-process replay of its rule: update k's step applied to the host store during update
k + 1, once that update's loads have read the weights without it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import stale_cases as cases
import torch

import pipetrain
from pipetrain.app import cli


def assert_matches_replay(per_rank: list[dict[str, Any]], expected: dict[str, Any]) -> None:
    """Every call's loss on every rank and the weights the ranks hold together at the end
    equal the replay's."""
    state: dict[str, torch.Tensor] = {}
    for result in per_rank:
        assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        assert not set(state) & set(result["state"]), "a stage held by two ranks"
        state.update(result["state"])
    assert sorted(state) == sorted(expected["state"])
    for name, value in expected["state"].items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_two_workers_four_stages_equal_the_replay_of_the_stale_rule() -> None:
    """With tied embeddings (the tied ends on ranks 0 and 1), clipping and two calls per
    update; every step's loss and the final weights."""
    config = {
        "clip": True,
        "tied": True,
        "microbatches": 4,
        "schedule_options": {"model_stages": 4},
    }
    per_rank = pipetrain.launch(cases.stale_loops, 2, [config], timeout_s=300)
    expected = cases.stale_replay(clip=True, tied=True)
    assert max(expected["norms"]) > cases.cases.MAX_NORM, "the clipping norm must really clip"
    results = [rank[0] for rank in per_rank]
    assert all(result["waited"] for result in results), "no step waited for the next update"
    assert all(result["updates"] == cases.UPDATES for result in results)
    for result in results:  # evaluated before update() applied the last step
        torch.testing.assert_close(result["evaluated"], expected["evaluated"])
    assert_matches_replay(results, expected)


def test_the_replay_of_the_stale_rule_is_not_the_synchronous_loop() -> None:
    """The first update computes on the initial weights either way; from the second on the
    stale rule's losses differ from the unpipelined synchronous loop's (so matching the
    replay says something)."""
    synchronous = cases.cases.reference_loop(clip=True)["losses"]
    stale = cases.stale_replay(clip=True)["losses"]
    calls = len(synchronous)
    assert stale[: cases.cases.ACCUMULATE] == pytest.approx(synchronous[: cases.cases.ACCUMULATE])
    assert stale[cases.cases.ACCUMULATE : calls] != pytest.approx(
        synchronous[cases.cases.ACCUMULATE :], rel=1e-3
    )


@pytest.mark.slow
def test_three_workers_equal_the_replay_of_the_stale_rule() -> None:
    """Four stages with tied embeddings (both ends on rank 0, the weight stored once: its
    step waits for the last load of either stage), and six stages loaded one at a time
    without clipping."""
    configs: list[dict[str, Any]] = [
        {"clip": True, "tied": True, "microbatches": 3, "schedule_options": {"model_stages": 4}},
        {"clip": False, "microbatches": 4, "schedule_options": {"model_stages": 6, "resident": 1}},
    ]
    per_rank = pipetrain.launch(cases.stale_loops, 3, configs, timeout_s=300)
    for index, config in enumerate(configs):
        expected = cases.stale_replay(clip=config["clip"], tied=config.get("tied", False))
        assert_matches_replay([rank[index] for rank in per_rank], expected)


@pytest.mark.slow
def test_a_stale_checkpoint_is_refused_while_a_step_waits_and_resumes_exactly_after_update(
    tmp_path: Path,
) -> None:
    """Saved after two updates: refused with the step waiting; after ``update()`` applied
    it, saved, loaded by a new stale pipeline and trained on, as the replay that applies
    the waiting step at once after the second update."""
    per_rank = pipetrain.launch(cases.stale_saved_and_resumed, 2, str(tmp_path), timeout_s=300)
    expected = cases.stale_replay(clip=True, flush_after=cases.SAVED_AFTER)
    for result in per_rank:
        assert "call update() to apply it, then save" in result["refusal"]
        assert result["found"] == cases.SAVED_AFTER
    assert_matches_replay(per_rank, expected)


@pytest.mark.slow
def test_fp16_loss_scaling_skips_and_grows_as_the_stale_replay() -> None:
    """The mixed-precision tests' MLP and fp16 loop (updates overflow, back off and grow):
    an overflowed update leaves no step waiting, the one waiting from before is applied."""
    config = {"microbatches": 2, "balance": [1, 2, 1, 1], "schedule": "roundpipe"}
    config["schedule_options"] = {"model_stages": 4}
    per_rank = pipetrain.launch(cases.fp16_stale_loop, 2, config, timeout_s=300)
    expected = cases.fp16_stale_replay(microbatches=2)
    assert any(expected["skipped"]) and not all(expected["skipped"])
    for result in per_rank:
        assert result["skipped"] == expected["skipped"]
        assert result["scales"] == expected["scales"]
        assert result["losses"] == pytest.approx(expected["losses"], rel=1e-4)
    state: dict[str, torch.Tensor] = {}
    for result in per_rank:
        state.update(result["state"])
    assert sorted(state) == sorted(expected["state"])
    # the weights the fp16 casts read differ from the replay's in the last bit of a few
    # float32 values (as the synchronous loop's do); a cast that rounds the other way moves
    # the later gradients in their fp16 digits, which Adam carries into the weights at
    # about 1e-5: a step applied at the wrong time or rate moves them by about lr = 1e-2
    for name, value in expected["state"].items():
        torch.testing.assert_close(state[name], value, rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.slow
def test_train_stale_with_save_dir_resumes_as_the_run_that_went_on(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """``pipetrain train --stale --save-dir`` applies the waiting step before each save, so
    a run stopped after its first save and started again has the losses of one that went
    on."""
    common = ["train", "--model", "mlp", "--json", "--ranks", "2", "--schedule", "roundpipe"]
    common += ["--stale", "--model-stages", "4", "--microbatches", "2", "--save-every", "3"]

    def losses(*args: str) -> list[float]:
        capfd.readouterr()
        status = cli.main([*common, *args])
        out, err = capfd.readouterr()
        assert status == 0, err
        return list(json.loads(out.strip().splitlines()[-1])["losses"])

    whole = losses("--steps", "6", "--save-dir", str(tmp_path / "whole"))
    first = losses("--steps", "3", "--save-dir", str(tmp_path / "parts"))
    again = losses("--steps", "6", "--save-dir", str(tmp_path / "parts"))
    assert first == whole[:3] and again == whole
