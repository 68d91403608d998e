"""Measuring the links between workers: every rank gets the same figures, and they describe
the link (the capped case is in test_cluster.py)."""

from __future__ import annotations

import math

import pipetrain
from pipetrain.profiler.links import LARGE_BYTES, SMALL_BYTES, Link, bandwidth_of, measure_links


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
