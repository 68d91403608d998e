"""Workers sharing one machine's cores: the extra core time their work takes, measured."""

from __future__ import annotations

import math

import pytest
from shared_cores_cases import factors_on_one_core

import pipetrain
from pipetrain.app.shared_cores import slowdown_of


def test_the_factor_is_together_over_alone_and_never_below_one() -> None:
    assert slowdown_of(0.020, 0.023) == pytest.approx(1.15)
    assert slowdown_of(0.020, 0.019) == 1.0  # noise: sharing cannot speed work up
    for alone, together in ((0.0, 0.01), (math.nan, 0.01), (0.01, math.inf)):
        with pytest.raises(ValueError, match="need alone > 0"):
            slowdown_of(alone, together)


def test_ranks_take_turns_alone_and_then_all_run_at_once() -> None:
    # two ranks on one core: in turns each has it to itself; together each waits for the
    # other half the time, which the wall clock counts and the CPU time does not
    results = pipetrain.launch(factors_on_one_core, 2, threads_per_worker=1)
    assert results[0] == results[1]  # one factor for every rank
    wall, cpu = results[0]
    assert 1.6 < wall < 2.6
    assert 1.0 <= cpu < 1.4
