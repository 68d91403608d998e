"""The collector pause around allocation-heavy work leaves the collector as it found it."""

from __future__ import annotations

import gc

from pipetrain.allocation import collector_paused


class _Node:
    """A tracked object that can sit in a reference cycle."""

    def __init__(self) -> None:
        self.other: _Node | None = None


def test_what_the_work_keeps_lands_in_the_oldest_generation_and_nothing_stays_frozen() -> None:
    gc.collect()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with collector_paused():
        assert not gc.isenabled()
        kept = [_Node() for _ in range(1000)]
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0
    oldest = {id(obj) for obj in gc.get_objects(generation=2)}
    assert all(id(node) in oldest for node in kept)
    # a cycle the work left behind is still found by a full collection
    with collector_paused():
        first, second = _Node(), _Node()
        first.other, second.other = second, first
        del first, second
    assert gc.collect() >= 2


def test_a_callers_frozen_objects_stay_frozen_and_a_paused_caller_stays_paused() -> None:
    gc.collect()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with collector_paused():
            made = [_Node() for _ in range(100)]
        assert gc.get_freeze_count() == frozen
        assert made
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
