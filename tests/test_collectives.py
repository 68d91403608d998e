"""The workers' collectives, measured, and what the planner charges for them: no less than
measured, and no less than the links give."""

from __future__ import annotations

import json

import pytest

import pipetrain
from pipetrain.planning import Topology
from pipetrain.planning.candidates import Candidate
from pipetrain.planning.layouts import Layout
from pipetrain.profiler import LayerCost, Profile
from pipetrain.profiler.collectives import Collectives, measure_collectives

WEIGHTS = 4e6
"""Bytes of weights in each of the profile's two layers."""

# measured on 4 ranks: a ring moves 3/4 of the bytes through each member
MEASURED = Collectives(
    4, allreduce_byte_s=2e-9, gather_byte_s=1e-9, reduce_scatter_byte_s=3e-9, fixed_s=1e-4
)


def _profile(collectives: Collectives | None) -> Profile:
    layer = LayerCost(0.1, 0.2, parameter_bytes=WEIGHTS, optimizer_bytes=2 * WEIGHTS)
    return Profile([layer, layer], collectives=collectives)


def test_a_collective_over_fewer_replicas_moves_fewer_bytes_through_each() -> None:
    # over 2 replicas a member moves 1/2 of the bytes, against 3/4 over the 4 measured
    assert MEASURED.seconds("gather", WEIGHTS, 2) == pytest.approx(1e-4 + 1e-9 * WEIGHTS * 2 / 3)
    assert MEASURED.seconds("allreduce", WEIGHTS, 4) == pytest.approx(1e-4 + 2e-9 * WEIGHTS)
    assert MEASURED.seconds("reduce_scatter", WEIGHTS, 1) == 0.0


def test_the_planner_charges_the_measured_collectives_where_the_links_are_faster() -> None:
    topology = Topology.flat(4, 1e12, 0.0)  # links far faster than the measured collectives
    layout = ((0, 1, 2), (1, 2, 2))
    whole = Candidate(Layout(layout), "1f1b", 4, "never", _profile(MEASURED))
    costs = whole.costs(topology)
    expected = MEASURED.seconds("allreduce", WEIGHTS, 2)
    assert costs.per_stage("allreduce_s", 2) == pytest.approx([expected, expected])
    sharded = Candidate(Layout(layout, shard=True), "1f1b", 4, "never", _profile(MEASURED))
    costs = sharded.costs(topology)
    scatter, gather = (MEASURED.seconds(k, WEIGHTS, 2) for k in ("reduce_scatter", "gather"))
    assert costs.per_stage("allreduce_s", 2) == pytest.approx([scatter, scatter])
    assert costs.per_stage("gather_s", 2) == pytest.approx([gather, gather])
    # without measured collectives the links alone price them: a ring pass each way
    ring_pass = WEIGHTS / 2 / 1e12
    unmeasured = Candidate(Layout(layout, shard=True), "1f1b", 4, "never", _profile(None))
    assert unmeasured.costs(topology).per_stage("gather_s", 2) == pytest.approx([ring_pass] * 2)


def test_slow_links_price_the_collectives_above_what_was_measured() -> None:
    topology = Topology.flat(4, 1e6, 0.0)  # 4 s a ring pass of half the weights
    layout = Layout(((0, 1, 2), (1, 2, 2)), shard=True)
    costs = Candidate(layout, "1f1b", 4, "never", _profile(MEASURED)).costs(topology)
    assert costs.per_stage("gather_s", 2) == pytest.approx([WEIGHTS / 2 / 1e6] * 2)


def test_a_profile_keeps_its_collectives_through_json_and_rescaling() -> None:
    profile = _profile(MEASURED)
    again = Profile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert again.collectives == MEASURED
    assert profile.scaled(4).collectives == MEASURED
    assert Profile.from_dict({**_profile(None).to_dict()}).collectives is None


@pytest.mark.parametrize(
    "entry",
    [
        {"ranks": 2, "gather_byte_s": 1.0},
        {**MEASURED.to_dict(), "extra": 1},
        [1, 2],
    ],
)
def test_malformed_collectives_in_a_profile_are_refused(entry: object) -> None:
    data = {**_profile(None).to_dict(), "collectives": entry}
    with pytest.raises(ValueError, match="collectives must be an object"):
        Profile.from_dict(data)


def test_negative_or_single_rank_collectives_are_refused() -> None:
    with pytest.raises(ValueError, match=r"Collectives\.gather_byte_s"):
        Collectives(2, 1e-9, -1e-9, 1e-9, 0.0)
    with pytest.raises(ValueError, match="a collective needs 2 ranks"):
        Collectives(1, 1e-9, 1e-9, 1e-9, 0.0)


def test_every_rank_measures_the_same_collectives() -> None:
    measured = pipetrain.launch(measure_collectives, 2, 2, timeout_s=120)
    assert measured[0] == measured[1]
    costs = measured[0]
    assert costs is not None and costs.ranks == 2
    # a byte costs something to move and to reduce, and far less than a millisecond
    for per_byte in (costs.allreduce_byte_s, costs.gather_byte_s, costs.reduce_scatter_byte_s):
        assert 0 < per_byte < 1e-6


def test_one_rank_has_no_collectives() -> None:
    assert pipetrain.launch(measure_collectives, 1) == [None]
