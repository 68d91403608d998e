"""Measuring the links between workers: every rank gets the same figures, and they describe
the link (the capped case is in test_cluster.py)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

import pipetrain
from pipetrain.profiler.links import (
    LARGE_BYTES,
    SMALL_BYTES,
    Link,
    bandwidth_of,
    combined,
    measure_links,
)


def test_every_rank_gets_the_same_link_figures() -> None:
    links = pipetrain.launch(measure_links, 3, 2)
    assert links[0] == links[1] == links[2]
    bandwidth, latency = links[0]
    # loopback on one machine: faster than any network this emulates, messages in well
    # under a tenth of a second
    assert 1e7 < bandwidth < math.inf
    assert 0 < latency < 0.1


def test_one_worker_has_no_link() -> None:
    assert pipetrain.launch(measure_links, 1) == [Link(math.inf, 0.0)]


def test_a_noisy_fast_link_is_fast_but_finite() -> None:
    extra = LARGE_BYTES - SMALL_BYTES
    # a slow link: the large message's extra time is its bytes
    assert bandwidth_of(0.002, 0.322) == extra / 0.32
    # a fast one whose small round trip was delayed past the large one's
    assert bandwidth_of(0.004, 0.003) == extra / 0.0015
    assert bandwidth_of(0.003, 0.003) == extra / 0.0015


def measured_with_set_round_trips() -> Link:
    """:func:`measure_links` where rank ``s``'s link to the next rank takes ``s + 1`` ms a
    small round trip and ``10 (s + 1)`` ms more for the large message, and the latency's
    window holds as many round trips as fit in 12 ms."""
    import pipetrain.profiler.links as links

    def round_trips(sender: int, receiver: int, rank: int, size: int, count: int) -> list[float]:
        small = (sender + 1) * 1e-3
        if size == LARGE_BYTES:
            return [11 * small] * count
        # the first small round trip of each link an outlier, which the median ignores
        return [5 * small] + [small] * (count - 1)

    def latency_trips(sender: int, receiver: int, rank: int, deadline: float) -> list[float]:
        # a window of 12 ms on every link: the faster the link, the more round trips in it
        small = (sender + 1) * 1e-3
        return [small] * (12 // (sender + 1))

    links.time_round_trips, links.round_trips_until = round_trips, latency_trips
    return links.measure_links(rounds=3, latency_window_s=0.01)


def test_the_latency_is_the_mean_over_every_link_and_the_bandwidth_the_slowest() -> None:
    results = pipetrain.launch(measured_with_set_round_trips, 3)
    assert results[0] == results[1] == results[2]
    bandwidth, latency = results[0]
    # round trips: 12 of 1 ms on link 0, 6 of 2 ms on link 1, 4 of 3 ms on link 2; each
    # link's window weighs alike (a mean over every round trip would give 36 / 22 ms)
    assert math.isclose(latency, (1 + 2 + 3) / 3 / 2 * 1e-3)
    # the slowest link: 2, whose large message takes 30 ms more than its small one
    assert math.isclose(bandwidth, (LARGE_BYTES - SMALL_BYTES) / 0.03)


def measured_noting_who_computes() -> tuple[Link, list[tuple[int, float]]]:
    """:func:`measure_links` on this rank, with each stretch this rank spent computing noted:
    (how many latency round trips this rank had made by then, how long it computed)."""
    import time

    import pipetrain.profiler.links as links

    made = [0]
    real_trips, real_busy = links.round_trips_until, links.busy_until

    def latency_trips(sender: int, receiver: int, rank: int, deadline: float) -> list[float]:
        runs = real_trips(sender, receiver, rank, deadline)
        made[0] += 1
        return runs

    noted: list[tuple[int, float]] = []

    def busy(finished: Callable[[], bool]) -> None:
        start = time.perf_counter()
        real_busy(finished)
        noted.append((made[0], time.perf_counter() - start))

    links.round_trips_until, links.busy_until = latency_trips, busy
    return links.measure_links(rounds=2, latency_window_s=0.02), noted


def test_every_other_rank_computes_while_a_links_latency_is_timed() -> None:
    results = pipetrain.launch(measured_noting_who_computes, 3)
    assert results[0][0] == results[1][0] == results[2][0]
    assert 0 < results[0][0].latency_s < 1.0  # generous: a loaded machine is slow
    # links 0 -> 1, 1 -> 2, 2 -> 0, one at a time: each rank is outside one of them, and
    # computes through its window after the links it is part of that come before it
    for rank, (_, noted) in enumerate(results):
        assert len(noted) == 1, (rank, noted)
        made_before, computed_s = noted[0]
        assert made_before == {0: 1, 1: 2, 2: 0}[rank]
        assert computed_s >= 0.02 * 0.9


def test_measurements_combine_to_the_slowest_bandwidth_and_the_mean_latency() -> None:
    assert combined([Link(2e9, 0.004), Link(1e9, 0.001), Link(3e9, 0.001)]) == Link(1e9, 0.002)
    with pytest.raises(ValueError, match="at least one"):
        combined([])
