"""The planner's shortcuts choose what the exhaustive ways choose.

The unit-time order search stops timing a candidate order once it cannot win, and takes a
list schedule's span from the schedule itself; the planner skips simulating candidates
whose written bound rules them out. Each is checked against its exhaustive way, and the
written bound against the simulator.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import pytest
from planning_cases import random_case, resnet_like_profile
from user_schedule_cases import generate as reverse_gpipe

from pipetrain.planning import Topology, plan
from pipetrain.planning.fitting import fitting_candidates
from pipetrain.planning.verdicts import Verdicts
from pipetrain.schedules import (
    Action,
    Generated,
    Kind,
    ScheduleSpec,
    names,
    register,
    unregister,
)
from pipetrain.schedules.builtin import interleaved_zb, v_half, v_min, vshape, zb_v
from pipetrain.schedules.registry import Options


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 6, 8, 12])
def test_the_v_search_finds_the_exhaustive_order(ranks: int) -> None:
    caps = {family.slots(ranks) for family in (zb_v, v_half, v_min)} | {2, 3}
    for microbatches in (1, 2, 3, 4, 7, 8, 12, 24):
        for slots in caps:
            try:
                expected = vshape.v_orders(ranks, microbatches, slots, exhaustive=True)
            except ValueError:
                with pytest.raises(ValueError, match="no order holds"):
                    vshape.v_orders(ranks, microbatches, slots)
                continue
            assert vshape.v_orders(ranks, microbatches, slots) == expected


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("virtual", [2, 3])
def test_the_interleaved_zero_bubble_search_finds_the_exhaustive_order(
    ranks: int, virtual: int
) -> None:
    for microbatches in (1, 2, 3, 4, 6, 8, 12, 16):
        expected = interleaved_zb.orders(ranks, microbatches, virtual, exhaustive=True)
        assert interleaved_zb.orders(ranks, microbatches, virtual) == expected


def _without_reasons(plan_dict: dict[str, Any]) -> dict[str, Any]:
    reasons = ("rejected", "rejected_layouts")
    return {key: value for key, value in plan_dict.items() if key not in reasons}


# the last seeds are cases where schedules with chunks win
@pytest.mark.parametrize(
    "seeds",
    [
        range(0, 12),
        pytest.param(range(12, 24), marks=pytest.mark.slow),
        pytest.param(range(24, 36), marks=pytest.mark.slow),
        (116, 189, 207, 230, 239),
    ],
)
def test_the_plan_is_the_one_every_simulation_would_choose(seeds: Sequence[int]) -> None:
    # schedule, stages, replicas, micro-batches, recomputation, memory and predicted steps
    # all equal; only the reasons given for the schedules passed over may differ (a
    # candidate ruled out by its written bound is "slower at best" by that bound)
    for seed in seeds:
        profile, arguments = random_case(seed)
        try:
            exhaustive = plan(profile, exhaustive=True, **arguments)
        except ValueError as error:
            with pytest.raises(ValueError, match=re.escape(str(error))):
                plan(profile, **arguments)
            continue
        fast = plan(profile, **arguments)
        assert _without_reasons(fast.to_dict()) == _without_reasons(exhaustive.to_dict()), seed
        assert set(fast.rejected) == set(exhaustive.rejected), seed
        assert set(fast.rejected_layouts) == set(exhaustive.rejected_layouts), seed


@pytest.mark.parametrize("seed", range(8))
def test_the_bounds_never_exceed_the_simulated_step(seed: int) -> None:
    profile, arguments = random_case(seed)
    topology = Topology.parse(arguments["topology"])
    # the asynchronous and replicated families too, and roundpipe over a host link slow
    # enough that its loads and returns matter
    everything = names()
    fitting, _ = fitting_candidates(
        profile,
        topology,
        everything,
        [1, 3, 4, 8],
        None,
        True,
        None,
        lambda line: None,
        Verdicts(everything),
        False,
        host_link=2e8,
    )
    dealt = any(candidate.layout.host_link for candidate, _ in fitting)
    assert dealt == (len(profile.layers) >= topology.workers)  # a stage a worker at least
    assert fitting
    for candidate, _ in fitting:
        costs = candidate.costs(topology)
        bound = candidate.written_bound(costs)
        for cores in (None, 2):
            timeline, _, _ = candidate.build_and_simulate(costs, cores)
            # a replica's all-reduce overlaps the earlier stages' backwards: not both counted
            assert candidate.lower_bound(costs) <= timeline.makespan * (1 + 1e-12), candidate
            if bound is not None:
                assert bound <= timeline.makespan * (1 + 1e-12), (candidate, cores)


def test_most_candidates_are_not_simulated() -> None:
    profile = resnet_like_profile(64)
    progress: dict[bool, list[str]] = {True: [], False: []}
    plans = {
        exhaustive: plan(
            profile,
            topology="4x16GB/s,4x1.25GB/s",
            batch_size=256,
            exhaustive=exhaustive,
            progress=progress[exhaustive].append,
        )
        for exhaustive in (True, False)
    }
    assert _without_reasons(plans[False].to_dict()) == _without_reasons(plans[True].to_dict())
    simulated = {
        exhaustive: sum("candidates simulated" in line for line in lines)
        for exhaustive, lines in progress.items()
    }
    # 37 of its 300 or so candidates are simulated exhaustively, 4 with the written bound
    assert simulated[False] * 4 <= simulated[True]


def test_a_broken_generator_is_reported_as_without_the_bound() -> None:
    def generate(
        ranks: int, microbatches: int, replicas: Sequence[int] | None, options: Options
    ) -> Generated:
        orders, stage_ranks, facts = reverse_gpipe(ranks, microbatches, replicas, options)
        # a forward without its micro-batch, which the bound cannot place
        return Generated([[Action(Kind.FORWARD, 0)], *orders[1:]], stage_ranks, facts)

    register(ScheduleSpec(name="forward-without-microbatch", summary="broken", generate=generate))
    try:
        profile = resnet_like_profile(4)
        errors = []
        for exhaustive in (True, False):
            with pytest.raises(ValueError) as error:  # lowering's, or the validator's
                plan(
                    profile,
                    workers=2,
                    schedules=["forward-without-microbatch"],
                    exhaustive=exhaustive,
                )
            errors.append(f"{type(error.value).__name__}: {error.value}")
        assert errors[0] == errors[1]
    finally:
        unregister("forward-without-microbatch")
