"""Bring every rank down, with one clear message, when any rank fails.

The rank where the failure began writes it to the process group's key-value store and
re-raises; its process then ends, which breaks its connections, so every rank waiting on
it fails too, reads the store and names the rank and stage where it began.
"""

from __future__ import annotations

import time

import torch.distributed as dist

_KEY = "pipetrain/first_failure"
_POLL_S = 0.05


class PipelineError(RuntimeError):
    """A pipeline step failed; ``origin_rank`` and ``origin_stage`` name where it began."""

    def __init__(self, message: str, origin_rank: int | None, origin_stage: int | None) -> None:
        """Keep the message and where the failure began."""
        super().__init__(message)
        self.origin_rank, self.origin_stage = origin_rank, origin_stage


def _store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def report_origin(rank: int, stage: int | None, message: str) -> PipelineError:
    """Record this rank's failure as the first one; if another rank's is already there (this
    rank failed in a collective because that one did), name that one instead."""
    store = _store()
    if store is None:
        return PipelineError(message, rank, stage)
    ours = f"{rank}\n{stage}\n{message}"
    try:
        first = store.compare_set(_KEY, "", ours).decode()
    except RuntimeError:  # the store itself is gone: the local error stands
        return PipelineError(message, rank, stage)
    if first in ("", ours):
        return PipelineError(message, rank, stage)
    return _from_record(rank, stage, first)


def _from_record(rank: int, stage: int | None, record: str) -> PipelineError:
    origin_rank, origin_stage, message = record.split("\n", 2)
    where = "" if origin_stage == "None" else f" (stage {origin_stage})"
    return PipelineError(
        f"rank {rank} (stage {stage}) stopped because rank {origin_rank}{where} "
        f"failed first: {message}",
        int(origin_rank),
        None if origin_stage == "None" else int(origin_stage),
    )


def explain_peer_failure(
    rank: int, stage: int | None, detail: str, wait_s: float = 5.0
) -> PipelineError:
    """An error for a rank that stopped because a peer did; names the origin if known."""
    store = _store()
    origin = None
    if store is not None:
        # polled, not store.wait: a wait that times out logs c10d noise after the real error
        deadline = time.monotonic() + wait_s
        try:
            while not store.check([_KEY]) and time.monotonic() < deadline:
                time.sleep(_POLL_S)
            origin = store.get(_KEY).decode() if store.check([_KEY]) else None
        except RuntimeError:
            origin = None
    if origin:
        return _from_record(rank, stage, origin)
    return PipelineError(f"rank {rank} (stage {stage}) stopped: {detail}", None, None)
