"""Workers sharing one machine's cores: the extra core time their work takes, measured."""

from __future__ import annotations

import math

import pytest
from shared_cores_cases import ALONE_S, TOGETHER_S, factor_on_a_counted_clock

import pipetrain
from pipetrain.app.shared_cores import slowdown_of


def test_the_factor_is_together_over_alone_and_never_below_one() -> None:
    assert slowdown_of(0.020, 0.023) == pytest.approx(1.15)
    assert slowdown_of(0.020, 0.019) == 1.0  # noise: sharing cannot speed work up
    for alone, together in ((0.0, 0.01), (math.nan, 0.01), (0.01, math.inf)):
        with pytest.raises(ValueError, match="need alone > 0"):
            slowdown_of(alone, together)


def test_ranks_take_turns_alone_and_then_all_run_at_once() -> None:
    """One core for two ranks: rank 0 runs its turn, then rank 1, then both together;
    each side is the ranks' median run summed, so the factor is together over alone."""
    first, second = pipetrain.launch(factor_on_a_counted_clock, 2)
    assert first["factor"] == second["factor"] == pytest.approx(TOGETHER_S / ALONE_S)
    assert first["alone"][1] < second["alone"][0]  # in turns, rank 0's first
    assert max(first["alone"][1], second["alone"][1]) < min(first["together"], second["together"])
