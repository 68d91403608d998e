"""Topology strings parse to the right bandwidths; ranks map to the right links."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.planning.topology import Level, Topology, resolve


@pytest.mark.parametrize(
    ("text", "levels"),
    [
        ("4x16GB/s,4x10Gbit/s", [(4, 16e9), (4, 10e9 / 8)]),
        ("8x100Gbit/s", [(8, 12.5e9)]),
        ("2x1Gb/s", [(2, 1.25e8)]),
        ("2 x 8bps", [(2, 1.0)]),
        ("3×2.5MB/s", [(3, 2.5e6)]),
        ("2*1e3kB/s, 3x1TB/s", [(2, 1e6), (3, 1e12)]),
        ("2x64b/s", [(2, 8.0)]),
        ("5xinfB/s", [(5, math.inf)]),
    ],
)
def test_parse(text: str, levels: list[tuple[int, float]]) -> None:
    topology = Topology.parse(text)
    assert [(level.count, level.bandwidth) for level in topology.levels] == [
        (count, pytest.approx(bandwidth)) for count, bandwidth in levels
    ]
    assert topology.workers == math.prod(count for count, _ in levels)


@pytest.mark.parametrize(
    "text", ["4x16", "x16GB/s", "4x16GB/s,", "", "4x10gbit/s", "4x16GB/s;2x1GB/s", "4.5x1GB/s"]
)
def test_malformed_strings_quote_the_input_and_the_syntax(text: str) -> None:
    with pytest.raises(ValueError) as error:
        Topology.parse(text)
    assert repr(text) in str(error.value)
    assert "COUNTxBANDWIDTH" in str(error.value)


@pytest.mark.parametrize("text", ["0x1GB/s", "4x0GB/s"])
def test_zero_counts_and_bandwidths_are_rejected(text: str) -> None:
    with pytest.raises(ValueError, match=repr(text)):
        Topology.parse(text)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 64), st.floats(1.0, 1e13)), min_size=1, max_size=4))
def test_string_round_trip(levels: list[tuple[int, float]]) -> None:
    topology = Topology([Level(count, bandwidth) for count, bandwidth in levels])
    again = Topology.parse(str(topology))
    assert [level.count for level in again.levels] == [count for count, _ in levels]
    for level, (_, bandwidth) in zip(again.levels, levels):
        assert level.bandwidth == pytest.approx(bandwidth, rel=1e-9)


def test_span_bandwidth_is_the_slowest_link_between_ranks() -> None:
    topology = Topology.parse("4x16GB/s,2x10Gbit/s,2x1Gbit/s")
    assert topology.workers == 16
    assert topology.span_bandwidth(0, 0) == math.inf
    assert topology.span_bandwidth(0, 3) == 16e9
    assert topology.span_bandwidth(3, 4) == 1.25e9
    assert topology.span_bandwidth(7, 4) == 16e9
    assert topology.span_bandwidth(0, 8) == 1.25e8
    assert topology.span_bandwidth(9, 15) == 1.25e9
    with pytest.raises(ValueError, match="rank 16"):
        topology.span_bandwidth(0, 16)


def test_a_faster_upper_level_does_not_speed_up_a_slow_lower_one() -> None:
    topology = Topology([Level(2, 1e9), Level(2, 1e12)])
    assert topology.span_bandwidth(1, 2) == 1e9


def test_flat_and_resolve() -> None:
    assert Topology.flat(8).workers == 8
    assert Topology.flat(8, 1e9).span_bandwidth(0, 7) == 1e9
    assert resolve("2x1GB/s,3x1GB/s", None).workers == 6
    assert resolve(None, 4) == Topology.flat(4)
    assert resolve("2x1GB/s", 2).workers == 2
    with pytest.raises(ValueError, match="workers=3 does not match"):
        resolve("2x1GB/s", 3)
    with pytest.raises(ValueError, match="give workers"):
        resolve(None, None)
    with pytest.raises(ValueError, match="workers must be a positive integer"):
        resolve(None, 0)
    with pytest.raises(TypeError, match="topology must be"):
        resolve(3.5, None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "latencies"),
    [
        ("4x100Mbit/s@200us", [200e-6]),
        ("2x16GB/s@0.5ms,4x1Gbit/s@1s", [0.5e-3, 1.0]),
        ("2x16GB/s,4x1Gbit/s@30us", [0.0, 30e-6]),
    ],
)
def test_a_level_may_give_the_latency_of_a_message(text: str, latencies: list[float]) -> None:
    topology = Topology.parse(text)
    assert [level.latency_s for level in topology.levels] == [
        pytest.approx(latency) for latency in latencies
    ]
    again = Topology.parse(str(topology))
    assert [level.latency_s for level in again.levels] == [
        pytest.approx(latency, rel=1e-6) for latency in latencies
    ]


@pytest.mark.parametrize("text", ["4x1GB/s@", "4x1GB/s@3", "4x1GB/s@3xs", "4x1GB/s@-1ms"])
def test_a_malformed_latency_quotes_the_syntax(text: str) -> None:
    with pytest.raises(ValueError, match="LATENCY"):
        Topology.parse(text)


def test_a_negative_or_infinite_latency_is_refused() -> None:
    for latency in (-1e-3, math.inf, math.nan):
        with pytest.raises(ValueError, match="latency"):
            Level(2, 1e9, latency)


def test_span_latency_is_the_largest_on_the_way_between_ranks() -> None:
    topology = Topology([Level(2, 16e9, 5e-6), Level(2, 1e9, 200e-6), Level(2, 1e8, 1e-3)])
    assert topology.span_latency(3, 3) == 0.0
    assert topology.span_latency(0, 1) == pytest.approx(5e-6)
    assert topology.span_latency(1, 2) == pytest.approx(200e-6)
    assert topology.span_latency(7, 0) == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="rank 8 is outside"):
        topology.span_latency(0, 8)
