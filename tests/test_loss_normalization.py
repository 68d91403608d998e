"""Losses returned as (loss_sum, count): pipelined training equals the unpipelined model's
token mean over the whole padded batch, step for step, under every synchronous family,
with accumulation over calls and replicated stages; asynchronous families refuse them."""

from __future__ import annotations

from typing import Any

import normalization_cases as cases
import pytest
import torch

import pipetrain
from pipetrain.runtime.rank.losses import split_loss
from pipetrain.runtime.rank.normalize import check_kinds


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return pipetrain.launch(cases.two_ranks, 2, timeout_s=300)


@pytest.fixture(scope="module")
def three_ranks() -> list[dict[str, Any]]:
    return pipetrain.launch(cases.three_ranks, 3, timeout_s=300)


def assert_runs_match(per_rank: list[dict[str, Any]], configs: list[dict[str, Any]]) -> None:
    """Losses, the last update's gradients (AdamW would hide a wrong common factor) and
    the weights after it equal the reference's on every rank, replicas included."""
    for index, config in enumerate(configs):
        fp16 = config["microbatches"] if config.get("precision") == "fp16" else 0
        expected = cases.reference(config.get("accumulate", 1), fp16)
        tolerance = 2e-3 if fp16 else 1e-5  # float16 rounds sums and means differently
        state: dict[str, torch.Tensor] = {}
        for result in per_rank:
            run = result["runs"][index]
            assert run["losses"] == pytest.approx(expected["losses"], rel=tolerance), config
            for kind in ("state", "grads"):
                for name, value in run[kind].items():
                    torch.testing.assert_close(
                        value,
                        expected[kind][name],
                        rtol=tolerance,
                        atol=tolerance / 2,
                        msg=f"{kind} {name} under {config}",
                    )
            state.update(run["state"])
        assert sorted(state) == sorted(expected["state"]), config


def test_the_micro_batches_count_very_different_numbers_of_tokens() -> None:
    _, labels = cases.padded_batch(seed=0)
    counts = [int((part[:, 1:] != -100).sum()) for part in labels.tensor_split(4)]
    assert counts[0] < counts[-1] / 3, counts


def test_two_ranks_give_the_unpipelined_token_mean(two_ranks: list[dict[str, Any]]) -> None:
    assert_runs_match(two_ranks, cases.TWO_RANKS)


@pytest.mark.slow
def test_three_ranks_and_replicas_give_the_unpipelined_token_mean(
    three_ranks: list[dict[str, Any]],
) -> None:
    assert_runs_match(three_ranks, cases.THREE_RANKS)


def test_an_asynchronous_schedule_refuses_a_pair_and_names_the_fix(
    two_ranks: list[dict[str, Any]],
) -> None:
    message = two_ranks[1]["refusal"]
    assert "2bw updates before a step's count is known" in message, message
    assert "use a synchronous schedule" in message


def test_causal_lm_loss_reads_hugging_face_outputs_and_shifts() -> None:
    logits = torch.randn(2, 4, 5)
    labels = torch.tensor([[1, 2, -100, -100], [3, 4, 0, -100]])
    total, count = pipetrain.causal_lm_loss({"logits": logits}, labels)
    expected = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 5), labels[:, 1:].reshape(-1), reduction="sum"
    )
    assert int(count) == 3
    torch.testing.assert_close(total, expected)
    for wrapped in ((logits, None), type("Out", (), {"logits": logits})()):
        assert torch.equal(pipetrain.causal_lm_loss(wrapped, labels)[0], total)


def test_a_loss_that_changes_kind_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match=r"for 2 of 4 micro-batches and a scalar for the others"):
        check_kinds(2, 4, None)
    with pytest.raises(ValueError, match=r"returned a pair after returning a scalar"):
        check_kinds(4, 4, False)
    with pytest.raises(ValueError, match=r"return the same kind in every step"):
        check_kinds(0, 4, True)
    check_kinds(4, 4, None)
    check_kinds(0, 4, False)


def test_a_loss_that_is_neither_a_scalar_nor_a_pair_is_refused() -> None:
    with pytest.raises(ValueError, match=r"returned a pair on stage 1 that is not"):
        split_loss((torch.ones(3), 2), "the loss function", "on stage 1")
    loss, count = split_loss((torch.tensor(6.0), 4), "f", "here")
    assert count is not None and float(loss / count) == 1.5


def test_a_tensor_two_stages_of_a_rank_hold_is_divided_once() -> None:
    """A tied weight that both ends of a V schedule hold on one rank accumulates one
    gradient, which the step's count divides once (twice was the V schedules' defect)."""
    from pipetrain.runtime.rank.normalize import Normalizer

    tied, own = torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)
    tied.grad, own.grad = torch.full((3,), 6.0), torch.full((2,), 6.0)
    normalizer = Normalizer({0: [tied], 3: [own, tied]}, {}, lambda _: None, torch.device("cpu"))
    normalizer.divide(torch.tensor(3.0), returned=4, microbatches=4, updating=True)
    torch.testing.assert_close(tied.grad, torch.full((3,), 2.0))
    torch.testing.assert_close(own.grad, torch.full((2,), 2.0))


def test_replicas_of_two_stages_of_a_rank_sharing_a_parameter_are_refused() -> None:
    from pipetrain.model.frontend import SharedParameter
    from pipetrain.runtime.rank.shared import check_sharing
    from pipetrain.schedules import build
    from pipetrain.schedules.copies import data_parallel_copies

    tied = [SharedParameter({0: "embed.weight", 3: "head.weight"})]
    check_sharing(tied, build("zb-v", 2, 4))  # one copy: one tensor, one gradient
    check_sharing(tied, data_parallel_copies(build("interleaved", 2, 4, virtual=2), 2))
    with pytest.raises(ValueError, match="stages 0 and 3, both on rank 0 and replicated"):
        check_sharing(tied, data_parallel_copies(build("zb-v", 2, 4), 2))
