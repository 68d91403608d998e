"""Pipelined training equals unpipelined training, across schedules, balances and recomputation."""

from __future__ import annotations

import itertools
from typing import Any

import pipeline_cases as cases
import pytest
import torch
from pipeline_cases import merged, reference
from torch import nn

import pipetrain
from pipetrain.model.layers import stage_bounds
from pipetrain.runtime.rank.reduce import DEFAULT_BUCKET_BYTES


def assert_transparent(configs: list[dict], results: list[list], ranks: int) -> None:
    for index, config in enumerate(configs):
        make, data = cases.model_and_data(config)
        expected_loss, expected_grads = reference(make, data, config.get("batch", cases.BATCH))
        losses = [results[rank][index][0] for rank in range(ranks)]
        assert losses == [losses[0]] * ranks, f"{config}: ranks disagree on the loss"
        assert losses[0] == pytest.approx(expected_loss, rel=1e-5), config
        got = merged([results[rank][index][1] for rank in range(ranks)])
        assert sorted(got) == sorted(expected_grads), config
        for name, grad in expected_grads.items():
            torch.testing.assert_close(
                got[name], grad, rtol=1e-5, atol=1e-6, msg=f"{config}: {name}"
            )


CHUNKED_SINCE_ZERO_BUBBLE = ["zb-v", "v-half", "v-min", "looped-bfs", "interleaved-zb"]
"""The families with two chunks per rank beside interleaved: V-shaped and looped."""

TWO_RANK_CONFIGS = (
    [
        {"schedule": schedule, "balance": balance, "recompute": recompute, "microbatches": m}
        for schedule, balance, recompute, m in itertools.product(
            ["gpipe", "1f1b", "zb-h1"],
            [[1, 4], [3, 2], [4, 1]],
            ["never", "except_last", "always"],
            [1, 3, 5],
        )
    ]
    + [
        {"schedule": "interleaved", "balance": balance, "recompute": recompute, "microbatches": m}
        for balance, recompute, m in itertools.product(
            [[1, 1, 2, 1], [2, 1, 1, 1]], ["never", "always"], [2, 4]
        )
    ]
    + [
        {"schedule": schedule, "balance": balance, "recompute": recompute, "microbatches": m}
        for schedule, balance, recompute, m in itertools.product(
            CHUNKED_SINCE_ZERO_BUBBLE, [[1, 1, 2, 1], [2, 1, 1, 1]], ["never", "always"], [1, 3, 4]
        )
    ]
    + [
        {"schedule": "dualpipev", "balance": balance, "recompute": recompute, "microbatches": m}
        for balance, recompute, m in itertools.product(
            [[1, 1, 2, 1], [2, 1, 1, 1]], ["never", "always"], [4, 5]
        )
    ]
    + [
        {
            "schedule": "dualpipev",
            "balance": [1, 1, 2, 1],
            "recompute": recompute,
            "microbatches": m,
            "schedule_options": {"full_backward": True},
        }
        for recompute, m in itertools.product(["never", "always"], [4, 5])
    ]
    + [
        {"schedule": schedule, "balance": [2, 1], "microbatches": m, "tuple": True}
        for schedule, m in [("gpipe", 3), ("1f1b", 2), ("zb-h1", 4)]
    ]
    + [
        {"schedule": "1f1b", "balance": None, "microbatches": 2, "batch": 7},
    ]
)

THREE_RANK_CONFIGS = [
    {"schedule": schedule, "balance": balance, "recompute": recompute, "microbatches": m}
    for schedule, balance, recompute, m in itertools.product(
        ["gpipe", "1f1b", "zb-h1"], [[1, 1, 3], [2, 2, 1]], ["never", "except_last"], [1, 4]
    )
]

FOUR_RANK_CONFIGS = [
    {"schedule": schedule, "recompute": recompute, "microbatches": m, "deep": True}
    for schedule, recompute, m in itertools.product(
        CHUNKED_SINCE_ZERO_BUBBLE, ["never", "except_last"], [2, 5, 8]
    )
] + [
    {"schedule": "dualpipev", "recompute": recompute, "microbatches": m, "deep": True}
    for recompute, m in itertools.product(["never", "except_last"], [8, 9])
] + [  # full backwards: one pass, the gradient sent after the W, as torch's DualPipeV
    {"schedule": "dualpipev", "microbatches": m, "deep": True,
     "schedule_options": {"full_backward": True}}
    for m in (8, 9)
]  # fmt: skip

GPU_CONFIGS = [
    {
        "schedule": schedule,
        "balance": [3, 2],
        "recompute": recompute,
        "microbatches": 3,
        "device": "cuda",
    }
    for schedule, recompute in [("gpipe", "never"), ("1f1b", "always"), ("zb-h1", "except_last")]
] + [
    {"schedule": "interleaved", "balance": [1, 1, 2, 1], "microbatches": 4, "device": "cuda"},
    {"schedule": "1f1b", "balance": [2, 1], "microbatches": 2, "tuple": True, "device": "cuda"},
    {"schedule": "1f1b", "balance": [3, 2], "microbatches": 2, "batch": 7, "device": "cuda"},
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_two_ranks_sharing_a_gpu_under_gloo_match_the_unpipelined_model() -> None:
    # gloo sends only from host memory: every message is staged through pinned buffers
    results = pipetrain.launch(cases.run_configs, 2, GPU_CONFIGS, timeout_s=300)
    assert_transparent(GPU_CONFIGS, results, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_under_nccl_a_rank_trains_on_its_own_gpu() -> None:
    [(loss, device, got)] = pipetrain.launch(
        cases.one_stage_on_the_default_device, 1, backend="nccl", timeout_s=300
    )
    expected_loss, expected_grads = reference()
    assert device == "cuda:0"
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_every_schedule_balance_and_recompute_mode_matches_the_unpipelined_model() -> None:
    results = pipetrain.launch(cases.run_configs, 2, TWO_RANK_CONFIGS, timeout_s=300)
    assert_transparent(TWO_RANK_CONFIGS, results, 2)


def test_three_stages_match_the_unpipelined_model() -> None:
    results = pipetrain.launch(cases.run_configs, 3, THREE_RANK_CONFIGS, timeout_s=300)
    assert_transparent(THREE_RANK_CONFIGS, results, 3)


def test_four_ranks_with_two_chunks_each_match_the_unpipelined_model() -> None:
    results = pipetrain.launch(cases.run_configs, 4, FOUR_RANK_CONFIGS, timeout_s=300)
    assert_transparent(FOUR_RANK_CONFIGS, results, 4)


def test_dropout_is_identical_with_and_without_recomputation() -> None:
    never, always, except_last = zip(
        *pipetrain.launch(cases.dropout_runs, 2, ["never", "always", "except_last"])
    )
    for rank_never, rank_always, rank_except in zip(never, always, except_last):
        assert rank_never.keys() == rank_always.keys()
        for name in rank_never:
            torch.testing.assert_close(rank_always[name], rank_never[name], rtol=0, atol=0)
            torch.testing.assert_close(rank_except[name], rank_never[name], rtol=0, atol=0)
    # dropout really acted: without it the gradients differ
    plain = merged(list(reference()[1:]))
    first = merged(list(never))
    assert any(not torch.allclose(first[name], plain[name]) for name in plain)


def test_optimizer_steps_shape_changes_eval_and_timeline() -> None:
    rank0, rank1 = pipetrain.launch(cases.optimizer_and_shapes, 2)
    model = cases.mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for seed, size in [(1, 10), (2, 7)]:
        x, y = cases.batch(seed=seed, size=size)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert rank0["losses"] == pytest.approx(losses, rel=1e-5)
    state = {**rank0["state"], **rank1["state"]}
    for name, value in model.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6)
    for rank in (rank0, rank1):
        torch.testing.assert_close(
            rank["output"], model(cases.batch(seed=3)[0]), rtol=1e-5, atol=1e-6
        )
    timeline = pipetrain.Timeline.from_dict(rank0["timeline"])
    assert rank1["timeline"] is None
    kinds = {(e.rank, e.kind) for e in timeline.events}
    assert {
        (0, "F"),
        (0, "B"),
        (1, "F"),
        (1, "B"),
        (1, "RECV_F"),
        (0, "RECV_B"),
        (0, "STEP"),
    } <= kinds
    assert sum(e.kind == "F" for e in timeline.events) == 2 * 3


def test_argument_errors_name_the_value() -> None:
    messages = pipetrain.launch(cases.argument_errors, 2)[0]
    assert messages[0].startswith("ValueError: balance [2, 2] sums to 4 but the model has 5 layers")
    assert "balance [2, 1, 2] has 3 stages, but 1f1b on 2 ranks needs 2" in messages[1]
    assert (
        messages[2]
        == "ValueError: recompute must be one of never, except_last, always, got 'sometimes'"
    )
    assert messages[3].startswith("TypeError: loss_fn must be a callable")
    assert "batch of 10 samples is smaller than microbatches=12" in messages[4]


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_failing_rank_stops_every_rank_with_its_name(ranks: int) -> None:
    with pytest.raises(
        pipetrain.LaunchError,
        match=rf"rank {ranks - 1} \(stage {ranks - 1}\) failed at F{ranks - 1}.0: "
        "ValueError: bad shape on purpose",
    ) as error:
        pipetrain.launch(cases.failing_step, ranks, "explode", ranks, timeout_s=300)
    assert error.value.rank == ranks - 1


def test_other_ranks_name_the_rank_where_the_failure_began() -> None:
    messages = pipetrain.launch(cases.failing_step_messages, 3, 3, timeout_s=300)
    assert messages[2].startswith(
        "rank 2 (stage 2) failed at F2.0: ValueError: bad shape on purpose"
    )
    for rank in (0, 1):
        assert messages[rank].startswith(
            f"rank {rank} (stage {rank}) stopped because rank 2 (stage 2) failed first"
        )


def test_a_non_tensor_output_names_the_layer() -> None:
    with pytest.raises(pipetrain.LaunchError, match=r"layer '1'.*str"):
        pipetrain.launch(cases.failing_step, 2, "not-a-tensor", 2, timeout_s=300)


# bucket_bytes=1 gives every parameter a bucket of its own, started during the backward;
# with one micro-batch, replicas without work contribute zeros
REPLICATED_CONFIGS: list[dict[str, Any]] = [
    {
        "schedule": schedule,
        "balance": balance,
        "replicas": replicas,
        "microbatches": m,
        "recompute": recompute,
        "bucket_bytes": bucket_bytes,
    }
    for schedule, (balance, replicas), m, recompute, bucket_bytes in itertools.product(
        ["gpipe", "1f1b"],
        [([2, 3], [2, 1]), ([4, 1], [1, 2]), ([5], [3])],
        [1, 3, 4],
        ["never", "always"],
        [DEFAULT_BUCKET_BYTES, 1],
    )
]


def test_replicated_stages_match_the_unpipelined_model_and_stay_identical() -> None:
    results = pipetrain.launch(cases.replicated_runs, 3, REPLICATED_CONFIGS, timeout_s=300)
    for index, config in enumerate(REPLICATED_CONFIGS):
        expected_loss, expected_grads = reference()
        model = cases.mlp()
        stepped = {
            name: p.detach() - 0.1 * expected_grads[name] for name, p in model.named_parameters()
        }
        schedule = pipetrain.schedules.build(
            config["schedule"],
            sum(config["replicas"]),
            config["microbatches"],
            replicas=config["replicas"],
        )
        owned = {rank: stage for stage, ranks in enumerate(schedule.stage_ranks) for rank in ranks}
        bounds = stage_bounds(config["balance"])
        for rank in range(3):
            loss, grads, weights = results[rank][index]
            start, stop = bounds[owned[rank]]
            assert set(grads) == {
                n for n in expected_grads if start <= int(n.split(".")[0]) < stop
            }, config
            assert loss == pytest.approx(expected_loss, rel=1e-5), config
            for name, grad in grads.items():
                torch.testing.assert_close(
                    grad, expected_grads[name], rtol=1e-5, atol=1e-6, msg=f"{config}: {name}"
                )
                torch.testing.assert_close(weights[name], stepped[name], rtol=1e-5, atol=1e-6)
        # replicas of a stage hold bit-identical weights after the step
        for stage_ranks in schedule.stage_ranks:
            first = results[stage_ranks[0]][index][2]
            for other in stage_ranks[1:]:
                for name, value in results[other][index][2].items():
                    assert torch.equal(value, first[name]), (
                        f"{config}: replica {other} differs on {name}"
                    )


def test_targets_travel_from_the_input_stage_to_the_last() -> None:
    losses = [loss for rank in pipetrain.launch(cases.targets_from_first_stage, 3) for loss in rank]
    assert losses == pytest.approx([reference()[0]] * 6, rel=1e-5)


def test_eval_gathers_the_outputs_of_a_replicated_last_stage() -> None:
    outputs = pipetrain.launch(cases.replicated_eval, 3)
    for output in outputs:  # gathered on rank 1, then sent to every rank
        torch.testing.assert_close(
            output, cases.mlp()(cases.batch(seed=3)[0]), rtol=1e-5, atol=1e-6
        )
