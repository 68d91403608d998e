"""The schedule registry: a family defined here, outside the package, is accepted by name by
the builder, the simulator, the planner and the command line."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence

import pytest

import pipetrain
from pipetrain.app import cli
from pipetrain.profiler import LayerCost, Profile
from pipetrain.schedules import (
    Action,
    Generated,
    Kind,
    Option,
    ScheduleSpec,
    build,
    names,
    register,
    spec,
    unregister,
)
from pipetrain.schedules.registry import Options


def reverse_gpipe(
    ranks: int, microbatches: int, replicas: Sequence[int] | None, options: Options
) -> Generated:
    """GPipe with the backwards in reverse micro-batch order (last in, first out)."""
    orders = []
    for stage in range(ranks):
        order = [Action(Kind.FORWARD, stage, k) for k in range(microbatches)]
        order += [Action(Kind.BACKWARD, stage, k) for k in reversed(range(microbatches))]
        orders.append([*order, Action(Kind.STEP, stage)])
    return Generated(orders, [(stage,) for stage in range(ranks)])


LIFO = ScheduleSpec(
    name="gpipe-lifo",
    summary="GPipe with last-in first-out backwards",
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
    assert "gpipe-lifo" in names() and spec("gpipe-lifo") is lifo
    schedule = build("gpipe-lifo", 3, 4)
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
    with pytest.raises(ValueError, match="gpipe-lifo option unused must be an integer >= 1"):
        build("gpipe-lifo", 2, 2, unused=0)
    with pytest.raises(
        ValueError, match="gpipe-lifo has no option 'virtual'; its options are: unused"
    ):
        build("gpipe-lifo", 2, 2, virtual=2)
    with pytest.raises(ValueError, match="replicas are supported by gpipe, 1f1b, pipedream"):
        build("gpipe-lifo", 3, 2, replicas=[2, 1])


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
    plan = pipetrain.plan(Profile(layers, microbatch_size=1), workers=2, schedules=("gpipe-lifo",))
    assert plan.schedule == "gpipe-lifo" and plan.balance == [2, 2]
    assert (
        cli.main(
            [
                "simulate",
                "--schedule",
                "gpipe-lifo",
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
