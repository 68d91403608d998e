"""A worker process keeps the memory it frees: a step's allocations are not faulted back in."""

from __future__ import annotations

import multiprocessing
import platform
from collections.abc import Callable
from typing import Any

import pytest
from heap_cases import WEIGHT_PAGES, faults_per_training_step, kept_then_faults

import pipetrain
from pipetrain.app import cli

glibc_only = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="the allocator's settings are glibc's"
)


def _in_fresh_process(function: Callable[[], Any]) -> Any:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(function)


@glibc_only
def test_kept_memory_is_reused_where_the_default_allocator_faults_it_back_in() -> None:
    default = _in_fresh_process(faults_per_training_step)
    took, kept = _in_fresh_process(kept_then_faults)
    # the reference: under glibc's own policy each step faults its gradient and the
    # optimizer's temporaries back in (about twice the weight's pages, here)
    assert default > WEIGHT_PAGES / 2, (default, WEIGHT_PAGES)
    assert took
    assert kept < WEIGHT_PAGES / 10, (kept, WEIGHT_PAGES)


@glibc_only
def test_launched_workers_keep_their_freed_memory() -> None:
    for faults in pipetrain.launch(faults_per_training_step, 2, threads_per_worker=1):
        assert faults < WEIGHT_PAGES / 10, (faults, WEIGHT_PAGES)


def test_the_command_line_keeps_freed_memory_before_any_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []

    def recorded() -> bool:
        calls.append("kept")
        return True

    monkeypatch.setattr(cli, "keep_freed_memory", recorded)
    status = cli.main(["simulate", "--schedule", "gpipe", "--ranks", "2", "--microbatches", "2"])
    assert status == 0
    assert calls == ["kept"]
