"""Schedules the package does not ship: a family a user registers, and one written as text,
trained across two processes and checked against the unpipelined model; and the checks a
schedule value passes before it runs."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import replace
from types import ModuleType

import pytest
import torch
from pipeline_cases import merged, reference

import pipetrain
from pipetrain.runtime import PipelineConfig
from pipetrain.schedules import Kind, Schedule


@pytest.fixture
def user_cases() -> Iterator[ModuleType]:
    """The module that registers ``gpipe-lifo`` on import; unregistered afterwards, so no
    other test sees it."""
    module = importlib.import_module("user_schedule_cases")
    pipetrain.schedules.register(module.SPEC, replace=True)
    try:
        yield module
    finally:
        pipetrain.schedules.unregister(module.SPEC.name)


def assert_unpipelined(results: list[tuple[float, dict[str, torch.Tensor]]]) -> None:
    expected_loss, expected_grads = reference()
    assert results[0][0] == results[1][0] == pytest.approx(expected_loss, rel=1e-5)
    got = merged([grads for _, grads in results])
    assert sorted(got) == sorted(expected_grads)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_family_registered_by_the_user_trains_like_the_unpipelined_model(
    user_cases: ModuleType,
) -> None:
    assert "gpipe-lifo" in pipetrain.schedules.names()
    built = pipetrain.schedules.build("gpipe-lifo", 2, 4)
    assert built.compute_order(0)[4:] == ["B0.3", "B0.2", "B0.1", "B0.0"]
    results = pipetrain.launch(user_cases.train, 2, "gpipe-lifo", 4, timeout_s=300)
    assert_unpipelined(results)


def test_a_schedule_read_from_text_trains_like_the_unpipelined_model(
    user_cases: ModuleType,
) -> None:
    results = pipetrain.launch(user_cases.train, 2, None, 1, timeout_s=300)
    assert_unpipelined(results)


WRITTEN = """
rank 0: F0.0 F0.1 B0.0 B0.1 STEP0
rank 1: F1.0 B1.0 F1.1 B1.1 STEP1
"""


def test_a_schedule_value_is_checked_against_the_world_and_the_balance() -> None:
    schedule = Schedule.from_text(WRITTEN)
    config = PipelineConfig(schedule=schedule, balance=[2, 3])
    assert config.build(2, layers=5) is schedule
    assert config.per_update(schedule) == 2
    with pytest.raises(ValueError, match="the given schedule has 2 ranks, but the process group"):
        config.build(3, layers=5)
    with pytest.raises(ValueError, match=r"balance \[2, 2, 1\] has 3 stages, but the given"):
        replace(config, balance=[2, 2, 1]).build(2, layers=5)
    with pytest.raises(ValueError, match="microbatches=4, but the given schedule runs 2"):
        replace(config, microbatches=4).build(2, layers=5)
    with pytest.raises(ValueError, match="leave schedule_options, replicas and data_parallel out"):
        replace(config, schedule_options={"virtual": 2}).build(2, layers=5)


def test_a_schedule_built_without_lowering_is_refused_with_the_way_to_build_it() -> None:
    lowered = Schedule.from_text(WRITTEN)
    handmade = Schedule(
        name="handmade",
        stages=2,
        microbatches=2,
        ranks=tuple(tuple(a for a in lane if a.kind is not Kind.LOSS) for lane in lowered.ranks),
        stage_ranks=lowered.stage_ranks,
    )
    with pytest.raises(ValueError, match=r"build it with pipetrain\.schedules\.lower .*from_text"):
        PipelineConfig(schedule=handmade).build(2)


def test_an_asynchronous_schedule_value_needs_an_optimizer_and_updates_as_written() -> None:
    schedule = pipetrain.schedules.build("2bw", 2, 3)
    config = PipelineConfig(schedule=Schedule.from_text(schedule.describe()))
    with pytest.raises(ValueError, match="needs an optimizer; pass optimizer="):
        config.build(2, has_optimizer=False)
    # 2bw updates every 3 micro-batches, which the written schedule says as well
    assert config.per_update(config.build(2)) == 3 == PipelineConfig("2bw", 3).per_update(schedule)


def test_settings_name_what_is_wrong_and_the_fix() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'; choose one of gpipe, 1f1b"):
        PipelineConfig("zigzag").build(2)
    with pytest.raises(ValueError, match="1f1b has no option 'virtual'"):
        PipelineConfig("1f1b", schedule_options={"virtual": 2}).build(2)
    with pytest.raises(
        ValueError,
        match=r"replicas \[2, 1\] must give one count per stage \(2\) and add up to the 4",
    ):
        PipelineConfig("1f1b", replicas=[2, 1]).build(4)
    with pytest.raises(ValueError, match="pipedream updates the weights inside the step"):
        PipelineConfig("pipedream", 4).build(2, has_optimizer=False)
    with pytest.raises(ValueError, match="fewer than the 4 stages of interleaved on 2 ranks"):
        PipelineConfig("interleaved", 2).build(2, layers=3)
    with pytest.raises(ValueError, match="config= holds every setting; give balance inside it"):
        PipelineConfig.from_arguments(PipelineConfig(), None, **_settings(balance=[1, 1]))


def _settings(**given: object) -> dict[str, object]:
    """Pipeline's setting arguments at their defaults, but for ``given``."""
    defaults = {
        "balance": None,
        "microbatches": 1,
        "schedule": "1f1b",
        "recompute": "never",
    }
    return {**defaults, **given}


def test_a_plan_sets_the_split_and_the_schedule_options() -> None:
    plan = pipetrain.Plan(
        stages=[pipetrain.PlanStage(a, b) for a, b in [(0, 1), (1, 3), (3, 4), (4, 5)]],
        schedule="interleaved",
        microbatches=4,
        recompute="always",
        predicted_step_s=1.0,
        predicted_throughput=1.0,
        stage_memory_bytes=[0.0] * 4,
        ranks=2,
        microbatch_size=2,
        virtual=2,
    )
    config = PipelineConfig.from_plan(plan, targets_on_first_stage=True)
    assert config.schedule_options == {"virtual": 2} and config.targets_on_first_stage
    assert tuple(config.balance or ()) == (1, 2, 1, 1) and config.replicas is None
    assert config.build(2, layers=5).stages == 4
    with pytest.raises(ValueError, match="the plan sets microbatches; give either plan"):
        PipelineConfig.from_arguments(None, plan, **_settings(microbatches=8))
    with pytest.raises(ValueError, match="give either config or plan, not both"):
        PipelineConfig.from_arguments(config, plan, **_settings())
