"""RoundPipe trained by the runtime: stages whose weights, gradients and optimizer state
live in a host store, loaded onto the workers for their passes, against the unpipelined
model; the store's stages in a process's memory only while loaded."""

from __future__ import annotations

import copy
import errno
import os
from pathlib import Path
from typing import Any

import graph_cases
import precision_cases
import pytest
import roundpipe_cases as cases
import torch
from test_graph import _aliases, assert_same_training
from test_precision import assert_loop_matches
from torch import nn

import pipetrain
from pipetrain.runtime.config import PipelineConfig
from pipetrain.runtime.rank import host_store
from pipetrain.runtime.rank.stored_stage import HostWeights, StoredStage
from pipetrain.schedules import build
from pipetrain.schedules.residency import stepping_offloads

MIB = 1 << 20


def assert_matches_unpipelined(per_rank: list[dict[str, Any]], clip: bool) -> None:
    """Every call's loss on every rank, the weights the ranks hold together at the end and
    the evaluation after it equal the unpipelined loop's."""
    expected = cases.reference_loop(clip)
    if clip:
        assert max(expected["norms"]) > cases.MAX_NORM, "the clipping norm must really clip"
    state: dict[str, torch.Tensor] = {}
    for result in per_rank:
        assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        assert result["updates"] == cases.UPDATES
        assert result["private"] == 0, "parameters outside the store between calls"
        assert not set(state) & set(result["state"]), "a stage held by two ranks"
        state.update(result["state"])
        torch.testing.assert_close(result["evaluated"], expected["evaluated"])
    assert sorted(state) == sorted(expected["state"])
    for name, value in expected["state"].items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def two_workers() -> list[list[dict[str, Any]]]:
    config = {"clip": True, "microbatches": 4, "schedule_options": {"model_stages": 4}}
    return pipetrain.launch(cases.roundpipe_loops, 2, [config], timeout_s=300)


def test_two_workers_four_stages_clip_accumulate_and_evaluate_as_the_unpipelined_gpt(
    two_workers: list[list[dict[str, Any]]],
) -> None:
    assert_matches_unpipelined([rank[0] for rank in two_workers], clip=True)


def test_loads_and_offloads_are_measured_as_the_schedule_writes_them(
    two_workers: list[list[dict[str, Any]]],
) -> None:
    kinds = two_workers[0][0]["kinds"]
    schedule = build("roundpipe", 2, 4, model_stages=4)
    for rank, lane in enumerate(schedule.ranks):
        written = [(a.kind.value, a.stage) for a in lane if a.kind.value in ("LOAD", "OFFLOAD")]
        measured = [(kind, stage) for kind, stage in kinds if kind in ("LOAD", "OFFLOAD")]
        assert [k for k in measured if k[1] % 2 == rank] == written


@pytest.mark.slow
def test_three_workers_six_and_eight_stages_resident_one_and_two() -> None:
    """Also: a pair loss accumulated over calls (each call's gradients divided by its count
    while the earlier call's wait in the store), and updates by ``pipe.update()``."""
    configs: list[dict[str, Any]] = [
        {"clip": True, "microbatches": 3, "schedule_options": {"model_stages": 6, "resident": 1}},
        {"clip": False, "microbatches": 4, "schedule_options": {"model_stages": 8}},
        {"clip": True, "microbatches": 3, "token_loss": True, "schedule_options": {}},
        {"clip": True, "microbatches": 3, "explicit": True, "schedule_options": {}},
    ]
    per_rank = pipetrain.launch(cases.roundpipe_loops, 3, configs, timeout_s=300)
    for index, config in enumerate(configs):
        assert_matches_unpipelined([rank[index] for rank in per_rank], clip=config["clip"])


@pytest.mark.slow
def test_two_workers_eight_stages_of_a_meta_model_read_stage_by_stage(tmp_path: Path) -> None:
    """The model built on the meta device: each rank reads only its stages from the weights
    file, one at a time, into its store."""
    weights = tmp_path / "gpt.pt"
    torch.save(cases.gpt().state_dict(), weights)
    config = {
        "clip": True,
        "microbatches": 2,
        "schedule_options": {"model_stages": 8, "resident": 1},
        "weights": str(weights),
    }
    per_rank = pipetrain.launch(cases.roundpipe_loops, 2, [config], timeout_s=300)
    assert_matches_unpipelined([rank[0] for rank in per_rank], clip=True)


# the store, in one process ---------------------------------------------------------------
def test_a_stage_in_the_store_takes_private_memory_only_while_loaded() -> None:
    (sizes,) = pipetrain.launch(cases.resident_while_stored, 1, timeout_s=300)
    stored_alone = sizes["stored"]
    assert stored_alone < sizes["before"] - 48 * MIB  # the private copy gone, the store released
    assert sizes["loaded"] > stored_alone + 48 * MIB
    assert sizes["offloaded"] < stored_alone + 16 * MIB  # weights and gradient freed
    assert sizes["weight_kept"] and sizes["gradient_right"]


def test_a_backward_after_its_stage_was_offloaded_and_loaded_again_is_exact() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3))
    reference = copy.deepcopy(model)
    stored = StoredStage(0, model, torch.device("cpu"))
    x = torch.randn(6, 4)
    for _ in range(2):  # the second time, gradients add to those in the store
        stored.load()
        output = model(x)
        stored.offload()  # the forward's residency ends: the working copies are freed
        stored.load()
        output.square().sum().backward()
        stored.offload()
        reference(x).square().sum().backward()
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert got.grad is not None and want.grad is not None
        assert torch.equal(got.grad, want.grad), name


def test_a_parameter_two_stages_share_is_stored_once_and_gets_both_gradients() -> None:
    torch.manual_seed(0)
    tied = nn.Linear(4, 4)
    first, last = nn.Sequential(tied, nn.Tanh()), nn.Sequential(nn.Linear(4, 4), tied)
    reference = copy.deepcopy(nn.Sequential(first, last))
    host = HostWeights(torch.device("cpu"))
    host.adopt(0, first)
    host.adopt(1, last)
    assert tied.weight.data_ptr() == host.stages[0].master.bytes.data_ptr()
    x = torch.randn(3, 4)
    host.load(0)
    hidden = first(x)
    host.offload(0)
    host.load(1)
    arriving = hidden.detach().requires_grad_()
    last(arriving).square().sum().backward()
    host.offload(1)
    host.load(0)
    hidden.backward(arriving.grad)
    host.offload(0)
    reference(x).square().sum().backward()
    expected = dict(reference.named_parameters())
    for name, parameter in nn.Sequential(first, last).named_parameters():
        assert parameter.grad is not None
        torch.testing.assert_close(parameter.grad, expected[name].grad, msg=name)


def test_after_a_failed_run_the_parameters_are_the_store_with_the_gradients_held_before() -> None:
    model = nn.Linear(3, 2)
    host = HostWeights(torch.device("cpu"))
    host.adopt(0, model)
    x = torch.randn(4, 3)
    host.load(0)
    model(x).sum().backward()
    host.offload(0)
    assert model.weight.grad is not None
    before = model.weight.grad.clone()
    host.load(0)
    model(x).sum().backward()  # the run fails here, with the stage resident
    host.settle(None)
    assert model.weight.data_ptr() == host.stages[0].master.bytes.data_ptr()
    assert not host.stages[0].resident
    assert torch.equal(model.weight.grad, before)


def test_the_optimizer_steps_the_store_and_its_state_moves_there() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3))
    reference = copy.deepcopy(model)
    stored = StoredStage(0, model, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    expected = torch.optim.AdamW(reference.parameters(), lr=0.1)
    x = torch.randn(6, 4)
    for _ in range(3):
        stored.load()
        model(x).sum().backward()
        stored.offload()
        optimizer.step()
        stored.adopt_state(optimizer)
        optimizer.zero_grad()
        reference(x).sum().backward()
        expected.step()
        expected.zero_grad()
    spans = [(r.bytes.data_ptr(), r.bytes.data_ptr() + r.bytes.numel()) for r in stored.regions()]
    for parameter, want in zip(model.parameters(), reference.parameters()):
        assert torch.equal(parameter, want)
        for key in ("exp_avg", "exp_avg_sq"):
            pointer = optimizer.state[parameter][key].data_ptr()
            assert any(start <= pointer < end for start, end in spans), key
        assert any(start <= parameter.data_ptr() < end for start, end in spans)


def test_the_stage_steps_at_its_last_offload_that_returns_gradients() -> None:
    lane = build("roundpipe", 2, 2, model_stages=4).ranks[0]
    # rank 0: stage 0 is offloaded after its forwards and after its backwards, stage 2 once
    assert stepping_offloads(lane) == {0: 2, 2: 1}


def test_a_balance_gives_one_entry_per_model_stage() -> None:
    options = {"model_stages": 4}
    config = PipelineConfig(schedule="roundpipe", balance=[1, 2, 1, 1], schedule_options=options)
    assert config.build(world=2, layers=5).stages == 4
    with pytest.raises(ValueError, match=r"balance \[2, 3\] has 2 stages, but roundpipe"):
        PipelineConfig(schedule="roundpipe", balance=[2, 3], schedule_options=options).build(
            world=2, layers=5
        )


def test_what_a_host_store_cannot_run_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"roundpipe keeps each stage's weights .* stage 0 on"):
        PipelineConfig(schedule="roundpipe", microbatches=4, data_parallel=2).build(world=4)


# checkpoints ------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_checkpoint_moves_between_roundpipe_and_1f1b_and_training_goes_on_as_unpipelined(
    tmp_path: Path,
) -> None:
    per_rank = pipetrain.launch(cases.checkpoints_across_layouts, 2, str(tmp_path), timeout_s=300)
    expected = cases.reference_loop(clip=True)
    for direction in ("to_1f1b", "to_roundpipe"):
        state: dict[str, torch.Tensor] = {}
        for rank in per_rank:
            result = rank[direction]
            assert result["found"] == cases.SAVED_AT // cases.ACCUMULATE
            assert result["updates"] == cases.UPDATES
            assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5), direction
            state.update(result["state"])
        assert sorted(state) == sorted(expected["state"])
        for name, value in expected["state"].items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


# a captured Hugging Face Llama with tied embeddings ---------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "options"),
    [
        (2, {"model_stages": 4}),  # the tied ends on ranks 0 and 1
        (3, {"model_stages": 6, "resident": 1}),  # on ranks 0 and 2
        (3, {"model_stages": 4}),  # both on rank 0, which stores the weight once
    ],
)
def test_a_captured_llama_with_tied_embeddings_trains_as_unpipelined(
    world: int, options: dict[str, int]
) -> None:
    """On padded batches with causal_lm_loss (a pair loss: the step's gradients divided by
    its token count), against the model's own token mean over the whole batch."""
    configs = [{"schedule": "roundpipe", "schedule_options": options}]
    per_rank = pipetrain.launch(graph_cases.train, world, "llama", configs, True, timeout_s=300)
    assert per_rank[0][0]["shared"] == ["lm_head.weight"]
    expected = graph_cases.reference("llama", padded=True)
    assert_same_training(expected, per_rank, _aliases("llama"), configs)


def test_a_region_that_shared_memory_cannot_hold_is_made_on_disk(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    full = tmp_path / "shm"
    full.mkdir()
    made: list[str] = []
    allocate = os.posix_fallocate

    def reserve(descriptor: int, offset: int, size: int) -> None:
        made.append(os.readlink(f"/proc/self/fd/{descriptor}"))
        if made[-1].startswith(str(full)):
            raise OSError(errno.ENOSPC, "No space left on device")
        allocate(descriptor, offset, size)

    monkeypatch.setattr(host_store, "SHARED_MEMORY", str(full))
    monkeypatch.setattr(host_store.os, "posix_fallocate", reserve)
    region = host_store.Region("test", 1000)
    region.bytes.fill_(7)
    assert made[0].startswith(str(full)) and not made[1].startswith(str(full))
    assert region.bytes.sum() == 7 * region.bytes.numel() and not list(full.iterdir())


@pytest.mark.slow
def test_fp16_loss_scaling_skips_and_grows_as_the_unpipelined_loop() -> None:
    """The mixed-precision tests' MLP and fp16 loop (updates overflow, back off and grow),
    with a parameter-free stage (Tanh, Dropout), whose rank steps nothing of it."""
    config = {
        "schedule": "roundpipe",
        "microbatches": 2,
        "balance": [1, 2, 1, 1],
        "precision": "fp16",
        "schedule_options": {"model_stages": 4},
    }
    per_rank = pipetrain.launch(precision_cases.pipelined_loop, 2, [config], timeout_s=300)
    assert_loop_matches([rank[0] for rank in per_rank], config)


def test_the_stores_step_holds_a_part_of_the_stage_at_a_time() -> None:
    # four 16 MiB layers: a step of the whole stage at once would touch its weights,
    # gradients and Adam's two moments in the store (4 x 64 MiB) and hold the first step's
    # new moments (2 x 64) in private memory besides; a part at a time it touches one
    # layer's (4 x 16), with that layer's new moments and Adam's temporaries
    (result,) = pipetrain.launch(cases.step_peaks, 1, timeout_s=300)
    first, later = result["peaks"]
    assert first < 10 * 16 * MIB, first / MIB
    assert later < 8 * 16 * MIB, later / MIB
    assert result["exact"]


def test_the_allocators_free_pages_are_given_back() -> None:
    (kept,) = pipetrain.launch(cases.freed_blocks_return, 1, False, timeout_s=300)
    (returned,) = pipetrain.launch(cases.freed_blocks_return, 1, True, timeout_s=300)
    assert returned > 56 * MIB
    assert kept < 8 * MIB, "the case must show what the setting changes"
