"""The planner's shortcuts choose what the exhaustive ways choose.

The unit-time order search stops timing a candidate order once it cannot win, and takes a
list schedule's span from the schedule itself: it finds the order that timing every
candidate in full finds.
"""

from __future__ import annotations

import pytest

from pipetrain.schedules.builtin import interleaved_zb, v_half, v_min, vshape, zb_v


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
