"""V-Half: two chunks per rank in a V, B and W apart, with half of 1F1B's activation memory.

A rank holds at most (p + 2) // 2 micro-batches' worth of activations; with F = B = W the
authors give a bubble of about p / 2m, half of 1F1B's. A micro-batch's worth is its
activations on one rank's layers, two chunk micro-batches; the order is the shortest at
unit costs within that.
"""

from __future__ import annotations

from pipetrain.schedules.builtin.vshape import v_spec


def slots(ranks: int) -> int:
    """Chunk micro-batches a rank may hold."""
    return 2 * ((ranks + 2) // 2)


SPEC = v_spec(
    "v-half",
    "V-Half: two chunks per rank in a V, B and W apart; half of 1F1B's activation memory",
    slots,
)
