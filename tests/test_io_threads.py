"""gloo's event-loop threads are marked SCHED_BATCH in every process group pipetrain uses."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import pytest
import torch
from io_threads_cases import (
    policies_after_launch,
    policies_after_replicated_pipeline,
    policies_after_tied_pipeline,
)

import pipetrain

UNNAMED = (
    f"gloo in torch {torch.__version__} leaves its event-loop thread unnamed (torch 2.11's "
    "does; 2.13's names it): there is nothing to defer"
)
linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="thread policies are read from /proc (Linux)"
)


@linux_only
def test_the_launcher_defers_gloos_loop_threads_and_not_the_computation() -> None:
    for loops, caller in pipetrain.launch(policies_after_launch, 2, threads_per_worker=1):
        if not loops:
            pytest.skip(UNNAMED)
        assert set(loops) == {os.SCHED_BATCH}
        assert caller == os.SCHED_OTHER


@linux_only
@pytest.mark.parametrize(
    "build",
    [policies_after_replicated_pipeline, policies_after_tied_pipeline],
    ids=["replicas", "tied"],
)
def test_groups_a_pipeline_makes_get_their_loop_threads_deferred_too(
    build: Callable[[], tuple[int, list[int]]],
) -> None:
    for before, after in pipetrain.launch(build, 2, threads_per_worker=1):
        if not after:
            pytest.skip(UNNAMED)
        assert len(after) > before, "the pipeline made no group with threads of its own"
        assert set(after) == {os.SCHED_BATCH}
