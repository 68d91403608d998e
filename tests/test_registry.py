"""The schedule registry: a family defined here, outside the package, is accepted by name by
the builder, the simulator, the planner and the command line."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from user_schedule_cases import generate as reverse_gpipe

import pipetrain
from pipetrain.app import cli
from pipetrain.profiler import LayerCost, Profile
from pipetrain.schedules import (
    Option,
    ScheduleSpec,
    build,
    names,
    register,
    spec,
    unregister,
)

LIFO = ScheduleSpec(
    name="lifo-with-option",
    summary="GPipe with last-in first-out backwards, and an option",
    generate=reverse_gpipe,
    options=(Option("unused", 3, "an option to check typing"),),
    planned_by_default=False,
)


@pytest.fixture
def lifo() -> Iterator[ScheduleSpec]:
    register(LIFO)
    try:
        yield LIFO
    finally:
        unregister(LIFO.name)


def test_a_registered_family_builds_and_simulates(lifo: ScheduleSpec) -> None:
    assert "lifo-with-option" in names() and spec("lifo-with-option") is lifo
    schedule = build("lifo-with-option", 3, 4)
    assert schedule.compute_order(2) == [
        "F2.0",
        "F2.1",
        "F2.2",
        "F2.3",
        "B2.3",
        "B2.2",
        "B2.1",
        "B2.0",
    ]
    timeline = pipetrain.simulate(schedule, pipetrain.Costs(1.0, 2.0))
    # the same fill and drain as GPipe: (m + p - 1)(F + B) at uniform costs
    assert timeline.makespan == pytest.approx((4 + 3 - 1) * 3.0)
    assert schedule.options["unused"] == 3


def test_options_are_typed_and_checked(lifo: ScheduleSpec) -> None:
    with pytest.raises(ValueError, match="lifo-with-option option unused must be an integer >= 1"):
        build("lifo-with-option", 2, 2, unused=0)
    with pytest.raises(
        ValueError, match="lifo-with-option has no option 'virtual'; its options are: unused"
    ):
        build("lifo-with-option", 2, 2, virtual=2)
    with pytest.raises(ValueError, match="replicas are supported by gpipe, 1f1b, pipedream"):
        build("lifo-with-option", 3, 2, replicas=[2, 1])


def test_a_name_is_registered_once(lifo: ScheduleSpec) -> None:
    with pytest.raises(ValueError, match="registered already; pass replace=True"):
        register(LIFO)
    assert register(LIFO, replace=True) is LIFO
    with pytest.raises(ValueError, match="unknown schedule 'nope'"):
        spec("nope")


def test_the_planner_and_the_command_line_accept_it(
    lifo: ScheduleSpec, capsys: pytest.CaptureFixture[str]
) -> None:
    layers = [LayerCost(forward_s=1.0, backward_s=2.0, name=f"l{i}") for i in range(4)]
    plan = pipetrain.plan(
        Profile(layers, microbatch_size=1), workers=2, schedules=("lifo-with-option",)
    )
    assert plan.schedule == "lifo-with-option" and plan.balance == [2, 2]
    assert (
        cli.main(
            [
                "simulate",
                "--schedule",
                "lifo-with-option",
                "--ranks",
                "2",
                "--microbatches",
                "3",
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["makespan"] == pytest.approx((3 + 2 - 1) * 3.0)
    assert result["textbook_bubble_fraction"] is None  # the spec states no formula


def test_a_generator_writing_the_wrong_number_of_ranks_is_named() -> None:
    broken = ScheduleSpec(
        name="one-rank-short",
        summary="forgets the last rank",
        generate=lambda ranks, microbatches, replicas, options: reverse_gpipe(
            ranks - 1, microbatches, replicas, options
        ),
    )
    register(broken)
    try:
        with pytest.raises(ValueError, match="one-rank-short generator wrote actions for 2 ranks"):
            build("one-rank-short", 3, 2)
    finally:
        unregister("one-rank-short")
