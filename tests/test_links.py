"""Measuring the links between workers: every rank gets the same figures, and they describe
the link (the capped case is in test_cluster.py)."""

from __future__ import annotations

import math

import pipetrain
from pipetrain.profiler.links import Link, measure_links


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
