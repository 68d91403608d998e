"""ZB-V, the V-ZB of the controllable-memory paper: two chunks per rank in a V, B and W apart.

A rank holds at most p micro-batches' worth of activations (2p chunk micro-batches), as
1F1B does; with F = B = W the bubble is near zero once m ≥ 2p
(sail-sg/zero-bubble-pipeline-parallelism). A micro-batch's worth is its activations on one
rank's layers, two chunk micro-batches; the order is the shortest at unit costs within that.
"""

from __future__ import annotations

from pipetrain.schedules.builtin.vshape import v_spec


def slots(ranks: int) -> int:
    """Chunk micro-batches a rank may hold."""
    return 2 * ranks


SPEC = v_spec(
    "zb-v",
    "ZB-V: two chunks per rank in a V, B and W apart; 1F1B's memory, a near-zero bubble",
    slots,
)
