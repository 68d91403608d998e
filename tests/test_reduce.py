"""Bucketed gradient all-reduce: bucket layout, start order, overlap and results."""

from __future__ import annotations

import pipeline_cases as cases
import pytest
import torch

import pipetrain
from pipetrain.runtime.rank.reduce import DEFAULT_BUCKET_BYTES, GradientReducer, buckets_of


def test_buckets_run_from_the_last_parameter_and_respect_the_size() -> None:
    parameters = [torch.zeros(3), torch.zeros(1), torch.zeros(5)]  # 12, 4 and 20 bytes
    assert buckets_of(parameters, 16) == [[2], [1, 0]]
    assert buckets_of(parameters, 1) == [[2], [1], [0]]
    assert buckets_of(parameters, 1e9) == [[2, 1, 0]]


@pytest.mark.parametrize(("bucket_bytes", "started_after_b"), [(1, 2), (DEFAULT_BUCKET_BYTES, 1)])
def test_buckets_start_during_the_backward_in_bucket_order(
    bucket_bytes: float, started_after_b: int
) -> None:
    results = pipetrain.launch(cases.reducer_progress, 2, bucket_bytes, timeout_s=300)
    # nothing starts before the backward, nor when only the first parameter's (second
    # bucket's) gradient is ready; everything once the last parameter's is; sums 1+2 and 3+3
    assert results == [[0, 0, started_after_b, 3, 6, 0]] * 2


def test_bucket_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bucket_bytes must be positive, got 0"):
        GradientReducer([torch.zeros(1)], None, 2, average=False, bucket_bytes=0)
