"""A message's CPU cost on each side, measured through the pipeline's transport."""

from __future__ import annotations

import math

import pipetrain
from pipetrain.app.message_costs import MessageCosts, measure_message_costs

LARGE = 4_000_000


def test_every_rank_gets_the_pairs_costs_and_bytes_cost_more_than_a_few() -> None:
    # rank 2 computes while ranks 0 and 1 exchange the messages
    measured = pipetrain.launch(
        measure_message_costs, 3, LARGE, math.inf, 6, 2, threads_per_worker=1
    )
    assert all(isinstance(costs, MessageCosts) for costs in measured)
    assert measured[0] == measured[1] == measured[2]
    fixed_s, send_byte_s, receive_byte_s = measured[0]
    assert 0 < fixed_s < 0.5  # generous: a loaded machine is slow
    # pushing 4 MB through the kernel costs the sender well over a few bytes' worth
    assert send_byte_s * LARGE > 0.2 * fixed_s
    assert receive_byte_s >= 0
