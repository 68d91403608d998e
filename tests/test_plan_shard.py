"""The planner plans sharded stages: the memory model of a shard against a hand
computation, a model that fits only sharded planned sharded, the choice between whole
copies and shards against simulating every candidate, the plan's mesh on the command line,
and a sharded plan trained on 4 gloo processes as the unpipelined model."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import plan_shard_cases
import pytest
import torch
import training_cases as cases
from test_cli import run_cli

import pipetrain
from pipetrain.planning import Plan, StageFootprint, Topology, plan, worker_memory
from pipetrain.planning.candidates import Candidate
from pipetrain.planning.fitting import fitting_candidates
from pipetrain.planning.layouts import Layout
from pipetrain.planning.planner import FEWER_WITHIN
from pipetrain.planning.verdicts import Verdicts
from pipetrain.profiler import LayerCost, Profile
from pipetrain.runtime import PipelineConfig
from pipetrain.schedules import Kind, spec

WEIGHTS = 1e8
"""Bytes of weights in each of the heavy profile's two layers (Adam: twice that of state)."""

HEAVY = Profile(
    [
        LayerCost(
            0.1, 0.2, activation_bytes=1e6, parameter_bytes=WEIGHTS, optimizer_bytes=2 * WEIGHTS
        )
        for _ in range(2)
    ],
    input_bytes=1e6,
)
SCHEDULES = ("1f1b", "gpipe")
COUNTS = (2, 4)

# a stage of 100 weight bytes, 200 of optimizer state, 1000 kept per micro-batch (5 of them
# its input), 500 of workspace, 10 sent forward
STAGE = StageFootprint(
    parameter_bytes=100,
    optimizer_bytes=200,
    activation_bytes=1000,
    input_bytes=5,
    workspace_bytes=500,
    output_bytes=10,
)
# weights outweighing the activations
WEIGHTY = StageFootprint(
    parameter_bytes=100, optimizer_bytes=200, activation_bytes=15, input_bytes=5, output_bytes=10
)


@pytest.mark.parametrize(
    ("footprint", "schedule", "microbatches", "expected"),
    [
        # gpipe: each of 2 replicas holds its 2 micro-batches before any backward, so the
        # gradients grow only as the first backward frees one (1000 > 100: none); shards
        # (100 + 200) / 2, gathered weights 100, 2 x 1000 kept, workspace, 2 outputs sent
        (STAGE, "gpipe", 4, 150 + 100 + 0 + 2 * 1000 + 500 + 2 * 10),
        # 1f1b on 8: 4 micro-batches a replica, 2 in flight, so a forward follows a backward
        # and the whole gradients (100) meet 2 micro-batches again; 4 outputs sent
        (STAGE, "1f1b", 8, 150 + 100 + 100 + 2 * 1000 + 500 + 4 * 10),
        # weights outweigh activations: the reduce-scatter's moment is the peak: shards,
        # whole gradients and their flat copy, the new shard of 50, the outputs sent
        (WEIGHTY, "gpipe", 4, 150 + 2 * 100 + 50 + 2 * 10),
        (WEIGHTY, "1f1b", 8, 150 + 2 * 100 + 50 + 4 * 10),
    ],
)
def test_sharded_worker_memory_by_hand(
    footprint: StageFootprint, schedule: str, microbatches: int, expected: float
) -> None:
    replicas = [2, 1]
    assert worker_memory([footprint], [False], schedule, 0, microbatches, replicas, shard=True) == (
        expected
    )
    # the stage on one rank holds it whole: sharding changes nothing there
    assert worker_memory(
        [footprint], [False], schedule, 1, microbatches, replicas, shard=True
    ) == worker_memory([footprint], [False], schedule, 1, microbatches, replicas)


def test_replicated_worker_memory_meets_the_all_reduce_by_hand() -> None:
    # weights, gradients, their flat copy for the all-reduce, optimizer state, 4 outputs sent
    assert worker_memory([WEIGHTY], [False], "1f1b", 0, 8, [2, 1]) == 3 * 100 + 200 + 4 * 10
    # the activations' moment where it is higher: 400 + 2 x 1000 + workspace + sent
    assert worker_memory([STAGE], [False], "1f1b", 0, 8, [2, 1]) == 400 + 2000 + 500 + 40


def test_replicated_worker_memory_counts_gradients_as_they_grow_by_hand() -> None:
    # gpipe: each of 2 replicas holds its 2 micro-batches before any backward, and the
    # gradients, cleared as the call starts, grow only as the first backward frees one
    # (1000 > 100: none): weights, optimizer state, 2 x 1000 kept, workspace, 2 outputs sent
    assert worker_memory([STAGE], [False], "gpipe", 0, 4, [2, 1]) == 300 + 2000 + 500 + 20
    # kept 60 a micro-batch: 40 of the gradients exist by then
    small = dataclasses.replace(STAGE, activation_bytes=60)
    assert worker_memory([small], [False], "gpipe", 0, 4, [2, 1]) == 340 + 120 + 500 + 20
    # the stage on one rank keeps the last update's gradients through the step, as measured
    # (its 4 micro-batches, 4 outputs sent)
    assert worker_memory([STAGE], [False], "gpipe", 1, 4, [2, 1]) == 400 + 4000 + 500 + 40


def test_a_model_that_fits_only_sharded_is_planned_sharded() -> None:
    limit = 4.5e8
    with pytest.raises(ValueError, match="no candidate plan fits a memory limit"):
        plan(HEAVY, workers=4, memory_limit=limit, schedules=SCHEDULES, shard=False)
    chosen = plan(HEAVY, workers=4, memory_limit=limit, schedules=SCHEDULES, microbatches=COUNTS)
    assert chosen.shard and chosen.replicas == [2, 2]
    # shards of (1e8 + 2e8) / 2, the weights gathered (1e8) and the reduce-scatter's whole
    # gradients and flat copy (2e8) and new shard (0.5e8), less than the limit
    assert max(chosen.stage_memory_bytes) <= limit
    assert min(chosen.stage_memory_bytes) >= 1.5e8 + 2e8 + 0.5e8
    # whole copies: weights, gradients and their flat copy (3e8), Adam (2e8), an output sent
    assert chosen.rejected_layouts["replicated"].startswith(
        "over the memory limit of 450 MB: needs at least 501 MB on a worker"
    )
    text = chosen.describe()
    assert "mesh: pp 2 x dp 2, sharded" in text
    assert "layouts rejected:\n  replicated: over the memory limit of 450 MB" in text
    config = PipelineConfig.from_plan(chosen)
    assert config.shard and config.replicas == (2, 2)
    schedule = config.build(world=4, layers=2)
    assert [len(ranks) for ranks in schedule.stage_ranks] == [2, 2]


def _brute_force(topology: Topology) -> list[tuple[float, Candidate]]:
    """Every candidate the planner considers, each simulated in full (a sharded stage's
    all-gathers are actions of its schedule): its throughput."""
    fitting, _ = fitting_candidates(
        HEAVY,
        topology,
        SCHEDULES,
        list(COUNTS),
        None,
        True,
        None,
        lambda _: None,
        Verdicts(SCHEDULES),
        False,
        shard=True,
    )
    results = []
    for candidate, _ in fitting:
        timeline, processed, _ = candidate.build_and_simulate(candidate.costs(topology))
        results.append((processed * HEAVY.microbatch_size / timeline.makespan, candidate))
    return results


@pytest.mark.parametrize("topology", ["4x100GB/s", "4x1GB/s", "4x100MB/s"])
def test_with_memory_to_spare_the_plan_is_as_fast_as_any_candidate(topology: str) -> None:
    network = Topology.parse(topology)
    results = _brute_force(network)
    best = max(throughput for throughput, _ in results)
    sharded = [t for t, c in results if c.layout.shard]
    whole = [t for t, c in results if not c.layout.shard and max(c.layout.replicas) > 1]
    assert sharded and whole
    # shards gather their weights before the first forward, where whole copies all-reduce at
    # the end: never faster in the model, and slower where the links are slow
    assert max(sharded) <= max(whole) * (1 + 1e-9)
    chosen = plan(HEAVY, topology=topology, schedules=SCHEDULES, microbatches=COUNTS)
    steady = chosen.predicted_throughput * chosen.predicted_step_s / chosen.steady_step_s
    assert best * (1 - FEWER_WITHIN) <= steady <= best * (1 + 1e-9)
    assert not chosen.shard
    assert "sharded" in chosen.rejected_layouts


def test_slow_links_make_shards_slower() -> None:
    slow = dict(_brute_force(Topology.parse("4x100MB/s")))
    # the same layouts sharded and whole: the gathers cost as much as the all-reduce's second
    # half, and a sharded stage waits for them before its first forward
    fast_sharded = max(t for t, c in _brute_force(Topology.parse("4x100GB/s")) if c.layout.shard)
    assert max(t for t, c in slow.items() if c.layout.shard) < 0.5 * fast_sharded


def test_gathers_and_the_reduce_scatter_by_hand() -> None:
    layout = Layout(((0, 1, 2), (1, 2, 2)), shard=True)
    candidate = Candidate(layout, "1f1b", 4, "never", HEAVY)
    topology = Topology.parse("4x100MB/s@1ms")
    # a ring pass over 2 replicas: one message of half the stage's weights, and a latency
    ring_pass = 1e-3 + WEIGHTS / 2 / 100e6
    costs = candidate.costs(topology)
    assert costs.per_stage("allreduce_s", 2) == pytest.approx([ring_pass, ring_pass])
    assert costs.per_stage("gather_s", 2) == pytest.approx([ring_pass, ring_pass])
    # each replica's lane starts with its gather, before the stage's first forward
    first = [lane[0].kind for lane in candidate.build().ranks]
    assert first == [Kind.GATHER] * 4
    whole = Candidate(Layout(layout.stages), "1f1b", 4, "never", HEAVY)
    assert whole.costs(topology).per_stage("allreduce_s", 2) == pytest.approx([2 * ring_pass] * 2)
    assert whole.costs(topology).per_stage("gather_s", 2) == [0.0, 0.0]
    assert Kind.GATHER not in {action.kind for lane in whole.build().ranks for action in lane}


def test_sharded_layouts_need_a_micro_batch_for_every_replica() -> None:
    layout = Layout(((0, 2, 4),), shard=True)
    assert not layout.runs("1f1b", 2) and layout.runs("1f1b", 4)
    assert not layout.runs("pipedream", 4)  # updates inside the step


def test_plan_prints_the_mesh(tmp_path: Any) -> None:
    profile = tmp_path / "heavy.json"
    HEAVY.save(profile)
    arguments = ["plan", "--profile", str(profile), "--ranks", "4", "--schedules", "1f1b"]
    done = run_cli(*arguments, "--memory", "450MB")
    assert done.returncode == 0, done.stderr
    assert "mesh: pp 2 x dp 2, sharded" in done.stdout
    assert "layouts rejected:\n  replicated: over the memory limit of 450 MB" in done.stdout
    as_json = run_cli(*arguments, "--memory", "450MB", "--json")
    assert json.loads(as_json.stdout)["shard"] is True
    refused = run_cli(*arguments, "--memory", "450MB", "--no-shard")
    assert refused.returncode == 2 and "no candidate plan fits" in refused.stderr


def test_memory_plans_only_with_plan_auto() -> None:
    done = run_cli("train", "--model", "mlp", "--memory", "300kB")
    assert done.returncode == 2
    assert "--worker-memory is the limit --plan auto plans within" in done.stderr


@pytest.mark.slow  # 4 processes profiling, planning, training; planned sharded in-process above
def test_train_plans_within_memory_and_trains_sharded() -> None:
    # the built-in MLP on 4 ranks: whole copies need more than 300 kB a rank
    train = ["train", "--model", "mlp", "--ranks", "4", "--batch-size", "64", "--steps", "2"]
    done = run_cli(*train, "--plan", "auto", "--memory", "300kB", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["shard"] is True and max(report["replicas"]) > 1
    assert "layouts rejected:\n  replicated: over the memory limit of 300 kB" in done.stderr


def test_shard_only_plans_shards_where_whole_copies_would_win() -> None:
    # memory to spare on fast links: whole copies win, unless only shards may be planned
    whole = plan(HEAVY, topology="4x100GB/s", schedules=SCHEDULES, microbatches=COUNTS)
    assert not whole.shard
    sharded = plan(
        HEAVY, topology="4x100GB/s", schedules=SCHEDULES, microbatches=COUNTS, shard="only"
    )
    assert sharded.shard and max(stage.replicas for stage in sharded.stages) > 1
    with pytest.raises(ValueError, match="shard must be True, False or 'only', got 'yes'"):
        plan(HEAVY, workers=4, shard="yes")  # type: ignore[arg-type]


@pytest.mark.slow  # 2 processes profiling, planning and training
def test_train_plan_auto_shard_plans_only_shards() -> None:
    # 2 ranks of the built-in MLP: whatever else would win, --shard asks for shards
    train = ["train", "--model", "mlp", "--ranks", "2", "--steps", "2", "--json"]
    done = run_cli(*train, "--plan", "auto", "--shard")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["shard"] is True and report["replicas"] == [2]


@pytest.mark.slow  # 4 processes; sharded training is checked in the default suite by test_shard.py
def test_a_sharded_plan_trains_as_the_unpipelined_model() -> None:
    # the test MLP's 5 layers, profiled by hand so that only shards fit on 4 ranks
    mlp = Profile(
        [
            LayerCost(1.0, 2.0, activation_bytes=10, parameter_bytes=w, optimizer_bytes=2 * w)
            for w in (1000, 0, 0, 1000, 1000)
        ]
    )
    chosen = plan(mlp, workers=4, memory_limit=4500, schedules=("1f1b",), microbatches=(4,))
    assert chosen.shard and max(chosen.replicas) > 1
    per_rank = pipetrain.launch(plan_shard_cases.planned_loop, 4, chosen.to_dict(), timeout_s=300)
    expected = cases.reference_loop()
    state: dict[str, Any] = {}
    for result in per_rank:
        assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        assert result["sharded"] == (chosen.replicas[result["stage"]] > 1)
        state.update(result["state"])
    for name, value in expected["state"].items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert spec(chosen.schedule).replicable


def test_plans_of_format_4_load_as_whole_copies() -> None:
    chosen = plan(HEAVY, workers=4, memory_limit=4.5e8, schedules=("1f1b",), microbatches=(4,))
    assert Plan.from_dict(chosen.to_dict()) == chosen
    older = {**chosen.to_dict(), "format_version": 4}
    del older["shard"], older["rejected_layouts"]
    loaded = Plan.from_dict(older)
    assert not loaded.shard and loaded.rejected_layouts == {}
    assert loaded.replicas == chosen.replicas
