"""The training loop against the unpipelined model, step for step: gradient accumulation,
global clipping, AdamW with a warm-up and cosine schedule, parameter-free and replicated
stages; non-scalar losses and non-finite values; evaluation and the outputs of a step."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import training_cases as cases
from pipeline_cases import batch, gradients, mlp
from test_executor import V_SHAPE, play
from torch import nn

import pipetrain
from pipetrain.distributed.loopback import LoopbackGroup
from pipetrain.distributed.transport import PeerError
from pipetrain.runtime.rank.executor import ActionFailed
from pipetrain.runtime.rank.update import NonFiniteError
from pipetrain.runtime.rank.update_config import UpdateConfig
from pipetrain.schedules import Schedule


def assert_same_state(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


def assert_loops_match(per_rank: list[list[dict[str, Any]]], ranks_of: list[list[int]]) -> None:
    """Each loop's losses on every rank and its final weights equal the reference's."""
    expected = cases.reference_loop()
    assert max(expected["norms"]) > cases.MAX_NORM, "the clipping norm must really clip"
    for index, holders in enumerate(ranks_of):
        results = [per_rank[rank][index] for rank in range(len(per_rank))]
        for result in results:
            assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5)
            assert result["updates"] == cases.UPDATES
        state: dict[str, torch.Tensor] = {}
        for rank in holders:  # one rank per stage; replicas are compared among themselves
            state.update(results[rank]["state"])
        assert_same_state(state, expected["state"])


def assert_clip_matches(results: list[tuple[float, dict[str, torch.Tensor]]]) -> None:
    model = mlp()
    nn.functional.cross_entropy(model(batch()[0]), batch()[1]).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cases.MAX_NORM))
    assert norm > cases.MAX_NORM
    assert [r[0] for r in results] == [results[0][0]] * len(results), "ranks disagree"
    assert results[0][0] == pytest.approx(norm, rel=1e-5)
    got: dict[str, torch.Tensor] = {}
    for _, grads in results:
        got.update(grads)
    expected = gradients(model.named_parameters())
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return pipetrain.launch(cases.two_rank_checks, 2, timeout_s=300)


@pytest.fixture(scope="module")
def three_ranks() -> list[dict[str, Any]]:
    return pipetrain.launch(cases.three_rank_checks, 3, timeout_s=300)


def test_two_stages_accumulate_clip_and_schedule_as_the_unpipelined_loop(
    two_ranks: list[dict[str, Any]],
) -> None:
    assert_loops_match([r["loop"] for r in two_ranks], [[0, 1], [0, 1]])


def test_a_parameter_free_stage_takes_part_and_counts_updates(
    three_ranks: list[dict[str, Any]],
) -> None:
    assert_loops_match([r["loop"][:1] for r in three_ranks], [[0, 1, 2]])
    middle = three_ranks[1]["loop"][0]
    assert middle["state"] == {} and middle["updates"] == cases.UPDATES
    assert not middle["has_optimizer"] and not middle["has_scheduler"]
    assert three_ranks[0]["loop"][0]["has_scheduler"]


def test_a_replicated_stage_counts_once_in_the_norm(three_ranks: list[dict[str, Any]]) -> None:
    loops = [r["loop"][1:] for r in three_ranks]
    assert_loops_match(loops, [[0, 2]])
    for name, value in loops[0][0]["state"].items():
        assert torch.equal(value, loops[1][0]["state"][name]), f"replicas differ on {name}"


def test_update_applies_what_non_updating_steps_accumulated(
    three_ranks: list[dict[str, Any]],
) -> None:
    expected = cases.reference_loop(updates=2)["state"]
    assert_same_state({**three_ranks[0]["update"], **three_ranks[2]["update"]}, expected)
    assert_same_state({**three_ranks[1]["update"], **three_ranks[2]["update"]}, expected)


def test_clip_grad_norm_returns_the_unpipelined_norm(
    two_ranks: list[dict[str, Any]], three_ranks: list[dict[str, Any]]
) -> None:
    assert_clip_matches([r["clip"][0] for r in two_ranks])
    replicated = [r["clip"][0] for r in three_ranks]
    assert_clip_matches([replicated[0], replicated[2]])
    assert replicated[1][0] == replicated[0][0]
    for name, grad in replicated[1][1].items():  # the replica was clipped alike
        assert torch.equal(grad, replicated[0][1][name]), name


def test_a_non_finite_step_raises_on_every_rank_and_leaves_the_weights(
    two_ranks: list[dict[str, Any]],
) -> None:
    for rank in two_ranks:
        result = rank["raise"]
        assert "non-finite values at update 2: loss nan" in result["error"]
        assert "the update was not applied" in result["error"]
        assert result["unchanged"] and result["moved_on"]
        assert (result["updates"], result["skipped"]) == (2, 0)


@pytest.mark.parametrize("policy", ["skip", "warn"])
def test_a_non_finite_step_is_skipped_on_every_rank(
    two_ranks: list[dict[str, Any]], policy: str
) -> None:
    for rank in two_ranks:
        result = rank[policy]
        assert result["error"] is None and result["unchanged"] and result["moved_on"]
        assert result["grads_after"] == 0, "a skipped update clears the gradients"
        assert (result["updates"], result["skipped"]) == (2, 1)
        assert len(result["warnings"]) == (policy == "warn")


def test_settings_that_cannot_run_are_refused(two_ranks: list[dict[str, Any]]) -> None:
    messages = two_ranks[0]["refusals"]
    assert (
        "max_grad_norm on pipedream needs every stage to run a micro-batch on the same "
        in (messages[0])
    )
    assert "vertical_sync" in messages[0]
    assert "on_nonfinite='skip' needs a synchronous schedule" in messages[1]
    assert messages[2].startswith("max_grad_norm acts at the pipeline's updates")
    assert messages[3] == "on_nonfinite must be one of raise, skip, warn, got 'ignore'"
    assert "cannot accumulate gradients over steps" in messages[4]


def test_a_non_scalar_loss_names_the_loss_and_stage_before_any_update() -> None:
    with pytest.raises(pipetrain.LaunchError) as error:
        pipetrain.launch(cases.non_scalar_loss, 2, timeout_s=300)
    assert error.value.rank == 1
    message = str(error.value)
    assert (
        "F1.0: ValueError: the loss function 'per_sample_loss' returned [5] on stage 1" in message
    )
    assert "the weights changed" not in message


def test_eval_step_runs_in_eval_mode_and_restores_each_layers_mode(
    two_ranks: list[dict[str, Any]],
) -> None:
    x = batch(seed=3)[0]
    expected = mlp(dropout=0.5).eval()(x).detach()
    assert not torch.allclose(mlp(dropout=0.5)(x), expected), "dropout must matter"
    for rank, result in enumerate(two_ranks):
        evaluation = result["eval"]
        torch.testing.assert_close(evaluation["all"], expected, rtol=1e-5, atol=1e-6)
        for to in (0, 1):
            if to == rank:
                torch.testing.assert_close(evaluation[f"to{to}"], expected, rtol=1e-5, atol=1e-6)
            else:
                assert evaluation[f"to{to}"] is None
        before, after = evaluation["modes"]
        assert after == before and True in before and False in before
        assert evaluation["refused"] == 'to must be "all" or a rank in 0..1, got 2'


def test_train_step_returns_the_unpipelined_outputs_on_the_first_last_stage_rank(
    two_ranks: list[dict[str, Any]], three_ranks: list[dict[str, Any]]
) -> None:
    x, y = batch(seed=4, size=11)
    expected = mlp()(x).detach()
    loss = nn.functional.cross_entropy(expected, y).item()
    for ranks in two_ranks, three_ranks:  # rank 1 holds (the first replica of) the last stage
        for rank, (got_loss, outputs) in enumerate(r["outputs"] for r in ranks):
            assert got_loss == pytest.approx(loss, rel=1e-5)
            if rank == 1:
                torch.testing.assert_close(outputs, expected, rtol=1e-5, atol=1e-6)
            else:
                assert outputs is None


# in one process: ranks as threads over the loopback transport ---------------------------
PIPEDREAM = """
rank 0: F0.0v0 F0.1v0 B0.0v0 STEP0v1 F0.2v1 B0.1v0 STEP0v2 F0.3v2 B0.2v1 STEP0v3 B0.3v2 STEP0v4
rank 1: F1.0v0 B1.0v0 STEP1v1 F1.1v1 B1.1v1 STEP1v2 F1.2v2 B1.2v2 STEP1v3 F1.3v3 B1.3v3 STEP1v4
"""


def poisoned(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(12, 4, generator=torch.Generator().manual_seed(seed))
    x[0, 0] = float("nan")
    return x, torch.randint(0, 3, (12,), generator=torch.Generator().manual_seed(seed))


def test_an_asynchronous_schedule_steps_the_scheduler_once_per_update() -> None:
    update = UpdateConfig(lr_scheduler=cases.scheduler)
    results = play(
        Schedule.from_text(PIPEDREAM), [2, 2], per_update=1, optimizer=True, update=update
    )
    assert [r.cycle.updates for r in results] == [4, 4]
    for result in results:
        scheduler = result.cycle.lr_scheduler
        assert scheduler is not None and scheduler.last_epoch == 4


def test_an_asynchronous_stage_refuses_a_non_finite_update() -> None:
    group = LoopbackGroup(2, timeout_s=10)
    with pytest.raises(NonFiniteError, match=r"stage \d's gradients are not finite"):
        play(
            Schedule.from_text(PIPEDREAM),
            [2, 2],
            per_update=1,
            optimizer=True,
            data=poisoned(),
            group=group,
        )


def test_every_rank_refuses_a_non_finite_update_with_two_stages_each() -> None:
    group = LoopbackGroup(2, timeout_s=10)

    with pytest.raises(NonFiniteError, match="loss nan"):
        play(
            Schedule.from_text(V_SHAPE),
            [1, 1, 1, 1],
            optimizer=True,
            data=poisoned(),
            group=group,
        )
    errors = group.errors()
    assert sorted(errors) == [0, 1]
    assert all(isinstance(e, NonFiniteError) for e in errors.values()), errors
    assert not any(isinstance(e, (ActionFailed, PeerError)) for e in errors.values())
