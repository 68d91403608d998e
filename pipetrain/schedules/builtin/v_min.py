"""V-Min: two chunks per rank in a V, B and W apart, with a third of 1F1B's activation memory.

A rank holds at most (p + 4) // 3 micro-batches' worth of activations; with F = B = W the
authors give a bubble of about 2p / 3m, two thirds of 1F1B's. A micro-batch's worth is its
activations on one rank's layers, two chunk micro-batches; the order is the shortest at
unit costs within that.
"""

from __future__ import annotations

from pipetrain.schedules.builtin.vshape import v_spec


def slots(ranks: int) -> int:
    """Chunk micro-batches a rank may hold."""
    return 2 * ((ranks + 4) // 3)


SPEC = v_spec(
    "v-min",
    "V-Min: two chunks per rank in a V, B and W apart; a third of 1F1B's activation memory",
    slots,
)
