"""Sharded stages: two pipeline stages, each on two replicas holding half of its parameters,
gradients and optimizer state (4 gloo processes), against the unpipelined model."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import graph_cases
import precision_cases
import pytest
import shard_cases
import torch
import training_cases as cases
from test_cli import run_cli

import pipetrain
from pipetrain.checkpoint import load_full


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("sharded"))
    return {
        schedule: pipetrain.launch(shard_cases.sharded_loop, 4, schedule, root, timeout_s=300)
        for schedule in ("gpipe", "1f1b")
    }


def assert_like_the_reference_loop(
    per_rank: list[dict[str, Any]], expected: dict[str, Any]
) -> None:
    """Every rank's losses and update count, and the weights the ranks end with together,
    equal the reference loop's."""
    state: dict[str, torch.Tensor] = {}
    for result in per_rank:
        assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        assert result["updates"] == cases.UPDATES
        state.update(result["state"])
    assert sorted(state) == sorted(expected["state"])
    for name, value in expected["state"].items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_sharded_replicas_train_as_the_unpipelined_model(
    runs: dict[str, list[dict[str, Any]]], schedule: str
) -> None:
    # accumulation over two calls, clipping that clips, AdamW and a learning-rate schedule
    expected = cases.reference_loop()
    assert max(expected["norms"]) > cases.MAX_NORM
    assert_like_the_reference_loop(runs[schedule], expected)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_measured_step_shows_each_replicas_gather_before_its_passes_and_its_reduction(
    runs: dict[str, list[dict[str, Any]]], schedule: str
) -> None:
    measured = runs[schedule][0]["measured"]
    for rank in range(4):
        kinds = [(kind, stage) for r, kind, stage in measured if r == rank]
        stage = rank // 2  # the pipeline dimension outermost
        assert kinds.count(("GATHER", stage)) == 1, kinds
        assert kinds.count(("ALLREDUCE", stage)) == 1, kinds
        first_pass = next(i for i, (kind, _) in enumerate(kinds) if kind in ("F", "B"))
        assert kinds.index(("GATHER", stage)) < first_pass
        assert kinds.index(("ALLREDUCE", stage)) > max(
            i for i, (kind, _) in enumerate(kinds) if kind == "B"
        )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_replica_holds_half_of_its_stage(
    runs: dict[str, list[dict[str, Any]]], schedule: str
) -> None:
    results = runs[schedule]
    for stage in range(2):  # stage s on ranks 2s and 2s + 1
        pair = results[2 * stage : 2 * stage + 2]
        # each replica holds its rows of every parameter: together, the whole stage once
        assert pair[0]["held"] + pair[1]["held"] == pair[0]["whole"] == pair[1]["whole"]
        for result in pair:
            assert result["held"] <= 0.6 * result["whole"]
            assert result["grad_held"] == result["held"]
            assert result["optimizer_held"] == 2 * result["held"]  # AdamW's two moments


def test_a_sharded_checkpoint_loads_into_the_unpipelined_model(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    expected = cases.reference_loop()
    for schedule, results in runs.items():
        model = cases.mlp(seed=5)
        found = load_full(Path(results[0]["saved"]), model)
        assert found.updates == cases.UPDATES, schedule
        for name, value in expected["state"].items():
            torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # 4 processes; the default suite keeps the exactness tests
def test_sharding_refuses_what_it_cannot_run() -> None:
    messages = pipetrain.launch(shard_cases.refusals, 4, timeout_s=300)[0]
    assert "shards each stage over its replicas, and no stage has any" in messages[0]
    assert "pipedream updates inside the step" in messages[1]
    assert "give at least 2 micro-batches" in messages[2]
    assert "a world size that 3 divides" in messages[3]


@pytest.mark.slow  # 4 processes; the default suite keeps the exactness tests
def test_fp16_on_sharded_replicas_skips_overflowing_updates_as_grad_scaler() -> None:
    expected = precision_cases.reference_loop("fp16", 4)
    assert any(expected["skipped"]) and not all(expected["skipped"])
    state: dict[str, torch.Tensor] = {}
    for result in pipetrain.launch(shard_cases.fp16_loop, 4, timeout_s=300):
        assert result["skipped"] == expected["skipped"]
        assert result["scales"] == expected["scales"]
        assert result["losses"] == pytest.approx(expected["losses"], rel=1e-4)
        state.update(result["state"])
    for name, value in expected["state"].items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow  # 4 processes; the default suite keeps the exactness tests
def test_a_sharded_checkpoint_loads_on_another_mesh(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    # saved by 2 stages x 2 sharded replicas, loaded by 4 stages of one rank each
    expected = cases.reference_loop()
    loaded = pipetrain.launch(
        shard_cases.loaded_on_four_stages, 4, runs["1f1b"][0]["saved"], timeout_s=300
    )
    state: dict[str, torch.Tensor] = {}
    for result in loaded:
        assert result["updates"] == cases.UPDATES
        state.update(result["state"])
    assert sorted(state) == sorted(expected["state"])
    for name, value in expected["state"].items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow  # 4 processes; the default suite keeps the exactness tests
def test_a_parameter_two_sharded_stages_use_stays_one() -> None:
    expected = graph_cases.sequential_reference()
    state: dict[str, torch.Tensor] = {}
    for result in pipetrain.launch(shard_cases.tied_on_sharded_replicas, 4, timeout_s=300):
        assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        assert result["shared"] == ["0.weight"]
        state.update(result["state"])
    for name, value in expected["state"].items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow  # 4 processes; the default suite keeps the exactness tests
def test_train_data_parallel_shard_from_the_command_line() -> None:
    done = run_cli(
        "train",
        *("--model", "mlp", "--data-parallel", "2", "--shard", "--steps", "3", "--json"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["ranks"] == 4 and report["stages"] == 2
    assert len(report["losses"]) == 3 and all(math.isfinite(x) for x in report["losses"])


def test_ddp_refuses_the_pipeline_data_parallel_flags() -> None:
    done = run_cli("train", "--model", "mlp", "--ddp", "--data-parallel", "2", "--shard")
    assert done.returncode == 2
    assert "--data-parallel, --shard set a pipeline" in done.stderr


def test_the_train_command_hands_its_workers_the_sharding() -> None:
    from pipetrain.app.train_config import TrainConfig
    from pipetrain.runtime import PipelineConfig

    pipeline = PipelineConfig(microbatches=4, data_parallel=2, shard=True)
    config = TrainConfig("mlp", pipeline, batch_size=16).resolved()
    assert config.workers == 4  # 2 stages x 2 replicas by default
    worker = config.worker_pipeline()
    assert worker.shard and worker.build(4, layers=5).stage_ranks == ((0, 1), (2, 3))


@pytest.mark.slow  # 4 processes capturing and training a Hugging Face model
def test_a_captured_llama_with_tied_embeddings_on_sharded_replicas() -> None:
    from test_graph import _aliases, assert_same_training

    configs: list[dict[str, Any]] = [
        {"schedule": "gpipe"},
        {"schedule": "1f1b"},
        {"schedule": "zb-h1"},
        {"schedule": "interleaved", "schedule_options": {"virtual": 2}},
    ]
    per_rank = pipetrain.launch(shard_cases.llama_on_sharded_replicas, 4, configs, timeout_s=300)
    assert all(result["shared"] for rank in per_rank for result in rank)  # tied across stages
    assert_same_training(graph_cases.reference("llama", True), per_rank, _aliases("llama"), configs)


COPIED = [
    ("zb-h1", {}, [2, 3]),
    ("interleaved", {"virtual": 2}, [1, 1, 1, 2]),
]


@pytest.mark.slow  # 4 processes a case
@pytest.mark.parametrize("shard", [False, True])
@pytest.mark.parametrize(("schedule", "options", "balance"), COPIED)
def test_copies_of_a_split_backward_or_interleaved_pipeline_train_as_the_unpipelined_model(
    schedule: str, options: dict[str, Any], balance: list[int], shard: bool
) -> None:
    expected = cases.reference_loop()
    per_rank = pipetrain.launch(
        shard_cases.copied_loop, 4, schedule, options, balance, shard, timeout_s=300
    )
    assert_like_the_reference_loop(per_rank, expected)


GPT_CONFIGS: dict[str, list[dict[str, Any]]] = {
    "one-chunk": [
        {"schedule": "gpipe", "balance": [2, 2]},
        {"schedule": "1f1b", "balance": [2, 2]},
    ],
    "split-or-chunked": [
        {"schedule": "zb-h1", "balance": [2, 2]},
        {"schedule": "interleaved", "schedule_options": {"virtual": 2}, "balance": [1, 1, 1, 1]},
    ],
}


# one launch a group; the default suite keeps the schedules the MLP's tests do not cover
@pytest.mark.parametrize(
    "group", [pytest.param(g, marks=pytest.mark.slow) for g in ("one-chunk", "split-or-chunked")]
)
def test_the_gpt_on_sharded_replicas_trains_as_the_unpipelined_model(group: str) -> None:
    # 2 ranks x 2 sharded replicas; accumulation over two calls, clipping that clips, AdamW
    # and a learning-rate schedule; then the global norm of an accumulating call's
    # gradients, each element counted once
    from test_tensor_parallel import assert_like_the_unpipelined_model

    configs = GPT_CONFIGS[group]
    per_rank = pipetrain.launch(shard_cases.gpt_on_sharded_replicas, 4, configs, timeout_s=300)
    for index, config in enumerate(configs):
        results = [rank[index] for rank in per_rank]
        assert all(result["final_norm"] is not None for result in results), config
        assert_like_the_unpipelined_model(results, "gpt")


ACCUMULATED: list[dict[str, Any]] = [
    *(
        {"shard": shard, "manual": manual, "more": more}
        for shard in (False, True)
        for manual, more in ((False, False), (True, True))
    ),
    # an embedding the last stage reuses: its parts summed by the clip, then added to
    *({"shard": shard, "manual": True, "more": True, "model": "tied"} for shard in (False, True)),
    # fp16: gradients unscaled by the clip, then added to
    {"shard": True, "manual": True, "more": True, "fp16": True},
]


def test_clipping_after_accumulation_on_whole_and_sharded_replicas() -> None:
    # two update=False calls, then pipe.update() clipping to max_grad_norm, or
    # pipe.clip_grad_norm_ first: the norm of the replicas' gradients summed, not of one
    # replica's own; and gradients added after that clip counted once by the update
    per_rank = pipetrain.launch(
        shard_cases.clipped_after_accumulation, 4, ACCUMULATED, timeout_s=300
    )
    for index, config in enumerate(ACCUMULATED):
        expected = shard_cases.accumulation_reference(config)
        assert max(expected["norms"]) > cases.MAX_NORM  # the clipping clips
        rel, atol = (1e-4, 1e-5) if config.get("fp16") else (1e-5, 1e-6)  # fp16's rounding
        state: dict[str, torch.Tensor] = {}
        for result in [rank[index] for rank in per_rank]:
            assert result["losses"] == pytest.approx(expected["losses"], rel=rel), config
            if config["manual"]:
                assert result["norms"] == pytest.approx(expected["norms"], rel=rel), config
            assert result["updates"] == cases.UPDATES
            state.update(result["state"])
        assert sorted(state) == sorted(expected["state"])
        for name, value in expected["state"].items():
            torch.testing.assert_close(
                state[name], value, rtol=rel, atol=atol, msg=f"{config} {name}"
            )


@pytest.mark.slow  # 4 processes; the default suite keeps the exactness tests
def test_a_sharded_checkpoint_continues_on_one_tensor_parallel_stage(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    # saved by 2 stages x 2 sharded replicas; loaded by 1 stage x 2 sharded replicas x 2
    # tensor-parallel processes, which trains one more update as the unpipelined loop does
    expected = cases.reference_loop(cases.UPDATES + 1)
    done = cases.UPDATES * cases.ACCUMULATE
    per_process = pipetrain.launch(
        shard_cases.continued_on_one_tensor_parallel_stage,
        4,
        runs["1f1b"][0]["saved"],
        timeout_s=300,
    )
    for result in per_process:
        assert result["found"] == cases.UPDATES
        assert result["updates"] == cases.UPDATES + 1
        assert result["held"] <= 0.5 * result["whole"]  # a quarter of the split layers
        assert result["losses"] == pytest.approx(expected["losses"][done:], rel=1e-5)
        assert sorted(result["state"]) == sorted(expected["state"])
        for name, value in expected["state"].items():
            torch.testing.assert_close(result["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
