"""Tensor-parallel stages: two pipeline stages, each played by two processes holding half of
its linear layers (4 gloo processes; with two replicas, 8), against the unpipelined model."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import tensor_parallel_cases as tp
import torch
from test_cli import run_cli

import pipetrain
from pipetrain.checkpoint import load_full

# the default suite runs one case of each model (4 processes each); the rest are slow
QUICK = {("mlp", "1f1b"), ("gpt", "zb-h1")}
CASES = [
    pytest.param(model, schedule, marks=[] if (model, schedule) in QUICK else pytest.mark.slow)
    for model in ("mlp", "gpt")
    for schedule in ("gpipe", "1f1b", "zb-h1")
]


class Runs(dict[tuple[str, str], list[dict[str, Any]]]):
    """Each (model, schedule) case launched on first use, then kept for the module."""

    def __missing__(self, case: tuple[str, str]) -> list[dict[str, Any]]:
        self[case] = pipetrain.launch(tp.tensor_parallel_loop, 4, *case, timeout_s=300)
        return self[case]


@pytest.fixture(scope="module")
def runs() -> Runs:
    return Runs()


def _noise_only(name: str, model: str) -> torch.Tensor | None:
    """Where a parameter's gradient is zero up to rounding (the GPT's key biases: attention
    ignores a constant added to every key), which Adam turns into steps of its learning
    rate whatever the rounding: those entries, compared loosely."""
    if model != "gpt" or not name.endswith("attn.qkv_by_head.bias"):
        return None
    size = tp.GPT["d_model"] // tp.GPT["heads"]
    key = torch.zeros(tp.GPT["heads"], 3, size, dtype=torch.bool)
    key[:, 1] = True  # laid out head by head: query, key, value
    return key.flatten()


def assert_like_the_unpipelined_model(per_rank: list[dict[str, Any]], model: str) -> None:
    """Every process's losses and update count, and the whole weights its stage ends with,
    equal the unpipelined loop's."""
    expected = tp.reference(model)
    assert max(expected["norms"]) > tp.cases.MAX_NORM  # the clipping clips
    for result in per_rank:
        assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        assert result["updates"] == tp.cases.UPDATES
        if result["final_norm"] is not None:  # every element counted once
            assert result["final_norm"] == pytest.approx(expected["final_norm"], rel=1e-4)
    state: dict[str, torch.Tensor] = {}
    for result in per_rank:
        for name, value in result["state"].items():
            if name in state:  # the mirrors of a rank hold the same whole weights
                torch.testing.assert_close(value, state[name], rtol=0, atol=0)
            state[name] = value
    assert sorted(state) == sorted(expected["state"])
    for name, value in expected["state"].items():
        loose = _noise_only(name, model)
        if loose is None:
            torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5, msg=name)
        else:
            torch.testing.assert_close(state[name][~loose], value[~loose], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(state[name][loose], value[loose], rtol=0, atol=1e-3)


@pytest.mark.parametrize(("model", "schedule"), CASES)
def test_tensor_parallel_stages_train_as_the_unpipelined_model(
    runs: dict[tuple[str, str], list[dict[str, Any]]], model: str, schedule: str
) -> None:
    # accumulation over two calls, clipping that clips, AdamW and a learning-rate schedule
    assert_like_the_unpipelined_model(runs[model, schedule], model)


@pytest.mark.parametrize(("model", "schedule"), CASES)
def test_activations_cross_once_per_group_of_mirrors(
    runs: dict[tuple[str, str], list[dict[str, Any]]], model: str, schedule: str
) -> None:
    # processes 0, 1 play stage 0 and 2, 3 stage 1: only the first of each sends, to the other's
    sent = [result["sent_to"] for result in runs[model, schedule]]
    assert sent == [[2], [], [0], []]


@pytest.mark.parametrize(("model", "schedule"), sorted(QUICK))
def test_each_mirror_holds_part_of_its_stage(
    runs: dict[tuple[str, str], list[dict[str, Any]]], model: str, schedule: str
) -> None:
    for result in runs[model, schedule]:
        assert result["held"] < 0.75 * result["whole"]


@pytest.mark.slow  # 4 processes a case
@pytest.mark.parametrize(("schedule", "options"), [("interleaved", {"virtual": 2}), ("zb-v", {})])
def test_two_stages_a_rank_on_tensor_parallel_stages(
    schedule: str, options: dict[str, Any]
) -> None:
    # the GPT's 4 layers as 4 stages on 2 ranks of 2 processes each
    per_rank = pipetrain.launch(tp.chunked_loop, 4, schedule, options, timeout_s=300)
    assert_like_the_unpipelined_model(per_rank, "gpt")
    assert [result["sent_to"] for result in per_rank] == [[2], [], [0], []]


def test_tensor_parallelism_refuses_what_it_cannot_split() -> None:
    messages = pipetrain.launch(tp.refusals, 4, timeout_s=300)[0]
    assert "tensor_parallel=2 needs a plan of how to split the model" in messages[0]
    assert "stage 0's tensor-parallel modules ['0'] (colwise) must come as pairs" in messages[1]
    assert "names '9', which matches no module" in messages[2]
    assert "'1' (colwise) names a Tanh" in messages[3]
    assert "'0' is 'sideways'; use one of ('colwise', 'rowwise')" in messages[4]
    assert "tensor_parallel=3 plays each rank of the schedule on 3 processes" in messages[5]
    assert "and 3 heads do not divide by 2" in messages[6]
    assert "does not run with an asynchronous schedule" in messages[7]


def test_a_dimension_that_does_not_divide_is_refused_by_name() -> None:
    from pipetrain.model.layers import to_layers
    from pipetrain.runtime.rank.tensor_parallel import model_plan

    layers = to_layers(tp.tp_mlp())  # Linear(6, 8) first
    with pytest.raises(ValueError, match=r"cannot split the 8 output features of '0' \(colwise\)"):
        model_plan(layers, {"0": "colwise", "2": "rowwise"}, 3)


@pytest.mark.slow  # 8 processes a case
@pytest.mark.parametrize(
    ("model", "schedule", "shard"),
    [("mlp", "1f1b", False), ("mlp", "1f1b", True), ("gpt", "zb-h1", True)],
)
def test_data_parallel_replicas_of_tensor_parallel_stages(
    model: str, schedule: str, shard: bool
) -> None:
    # 2 stages x 2 replicas x 2 mirrors: processes 4s + 2d + t; sharded, FSDP over each
    # stage's replicas of what tensor parallelism split (a dp x tp mesh)
    per_rank = pipetrain.launch(
        tp.data_parallel_loop, 8, model, schedule, shard, timeout_s=300, threads_per_worker=1
    )
    assert_like_the_unpipelined_model(per_rank, model)
    # ranks 0, 1 hold stage 0 (replicas under 1f1b, copies under zb-h1), 2, 3 stage 1
    assert [r["sent_to"] for r in per_rank] == [[4], [], [6], [], [0], [], [2], []]


def test_the_train_command_hands_its_workers_the_tensor_parallelism() -> None:
    from pipetrain.app.train_config import TrainConfig
    from pipetrain.runtime import PipelineConfig

    pipeline = PipelineConfig(microbatches=4, tensor_parallel=2)
    config = TrainConfig("gpt", pipeline, batch_size=16).resolved()
    assert config.workers == 4  # 2 stages x 2 processes by default
    worker = config.worker_pipeline()
    assert worker.tensor_parallel == 2 and worker.build(4).num_ranks == 2


@pytest.mark.slow  # 4 processes training the built-in GPT
def test_train_tensor_parallel_from_the_command_line() -> None:
    done = run_cli("train", *("--model", "gpt", "--tensor-parallel", "2", "--steps", "3", "--json"))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["ranks"] == 4 and report["stages"] == 2
    assert len(report["losses"]) == 3 and all(math.isfinite(x) for x in report["losses"])


def test_train_refuses_tensor_parallel_with_a_plan_or_ddp() -> None:
    done = run_cli("train", "--model", "gpt", "--tensor-parallel", "2", "--plan", "auto")
    assert done.returncode == 2 and "leave --plan out with --tensor-parallel 2" in done.stderr
    done = run_cli("train", "--model", "gpt", "--ddp", "--tensor-parallel", "2")
    assert done.returncode == 2 and "--tensor-parallel set a pipeline" in done.stderr


@pytest.mark.slow  # 4 processes, three runs
def test_recomputation_evaluation_and_checkpoints_of_tensor_parallel_stages(
    tmp_path: Path,
) -> None:
    per_rank = pipetrain.launch(tp.recomputed_evaluated_and_saved, 4, str(tmp_path), timeout_s=300)
    assert_like_the_unpipelined_model(per_rank, "mlp")
    expected = tp.reference("mlp")
    model = tp.tp_mlp()
    model.load_state_dict(expected["state"])
    with torch.no_grad():
        outputs = model(tp.cases.calls()[0][0])
    for result in per_rank:  # every process of every rank gets the outputs
        torch.testing.assert_close(result["evaluated"], outputs, rtol=1e-5, atol=1e-6)
    # into the unpipelined model, and into 2 stages without tensor parallelism
    unpipelined = tp.tp_mlp(seed=12)
    assert load_full(Path(per_rank[0]["saved"]), unpipelined).updates == tp.cases.UPDATES
    loaded = pipetrain.launch(tp.loaded_without_tensor_parallel, 2, per_rank[0]["saved"])
    state = {**loaded[0]["state"], **loaded[1]["state"]}
    for name, value in expected["state"].items():
        torch.testing.assert_close(unpipelined.state_dict()[name], value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # 4 processes
def test_fp16_on_tensor_parallel_stages_skips_overflowing_updates_as_grad_scaler() -> None:
    import precision_cases

    expected = precision_cases.reference_loop("fp16", 4)
    assert any(expected["skipped"]) and not all(expected["skipped"])
    state: dict[str, torch.Tensor] = {}
    for result in pipetrain.launch(tp.fp16_loop, 4, timeout_s=300):
        assert result["skipped"] == expected["skipped"]
        assert result["scales"] == expected["scales"]
        assert result["losses"] == pytest.approx(expected["losses"], rel=1e-4)
        state.update(result["state"])
    # a rowwise layer's partial sums are rounded to fp16 before they are added: weights
    # agree to fp16's rounding (2e-4 measured), not float32's
    for name, value in expected["state"].items():
        torch.testing.assert_close(state[name], value, rtol=1e-3, atol=1e-3, msg=name)


def test_a_message_crosses_once_and_reaches_every_mirror() -> None:
    per_process = pipetrain.launch(tp.mirrored_messages, 4, timeout_s=120)
    assert [sent for _, sent in per_process] == [[2, 2, 2], [], [0], []]
    for rows, message in zip((2, 2, 3), per_process[2][0]):
        expected = (
            torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3),
            torch.arange(rows, dtype=torch.int64) * 7,
            torch.tensor([True, False] * rows),
            torch.full((rows,), 0.5, dtype=torch.float16),
        )
        for got, want in zip(message, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    for mirrored, message in zip(per_process[3][0], per_process[2][0], strict=True):
        for got, want in zip(mirrored, message, strict=True):  # the leader's, to the mirror
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    gradient = torch.ones(4) * 2  # process 2 sent it; process 3's own was never sent
    for received, _ in per_process[:2]:
        torch.testing.assert_close(received[0][0], gradient, rtol=0, atol=0)
