"""Bring every rank down, with one clear message, when any rank fails.

The rank where the failure began writes it to the process group's key-value store and
re-raises; its process then ends, which breaks its connections, so every rank waiting on
it fails too, reads the store and names the rank and stage where it began.

The store is reachable by whoever can connect to it, so a record is believed only if it is
well formed (a rank of the group, a stage number, a message of bounded length) and, where
the ranks share a secret (:func:`sign_records`: :func:`~pipetrain.distributed.launch.launch`
gives its workers one; under torchrun, ``PIPETRAIN_STORE_SECRET`` set alike on every host),
signed with it. Anything else under the key is no one's failure: it is replaced by the
first real one, and a rank that reads it names only its own error.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time

import torch.distributed as dist

_KEY = "pipetrain/first_failure"
_POLL_S = 0.05
SECRET_ENV = "PIPETRAIN_STORE_SECRET"
_MESSAGE_CHARS = 2000  # of a recorded message; a longer one was not written by a rank
_NUMBER_DIGITS = 9
_UNSIGNED = "unsigned"
_secret: list[str | None] = [None]


def sign_records(secret: str | None) -> None:
    """Sign this process's failure records with ``secret`` and believe only records
    signed with it (``None``: ``PIPETRAIN_STORE_SECRET`` if set, else unsigned records)."""
    _secret[0] = secret


def _signature(body: str) -> str:
    secret = _secret[0] or os.environ.get(SECRET_ENV)
    if not secret:
        return _UNSIGNED
    return hmac.new(secret.encode(), body.encode(), hashlib.sha256).hexdigest()


def _record(rank: int, stage: int | None, message: str) -> str:
    body = f"{rank}\n{stage}\n{message[:_MESSAGE_CHARS]}"
    return f"{_signature(body)}\n{body}"


def _number(text: str) -> int | None:
    """``text`` as a small non-negative integer, or ``None``."""
    if text.isascii() and text.isdigit() and len(text) <= _NUMBER_DIGITS:
        return int(text)
    return None


def _parsed(raw: bytes) -> tuple[int, int | None, str] | None:
    """The origin rank, stage and message of a failure record; ``None`` for anything a rank
    of this group did not write (malformed, out of range, unsigned or wrongly signed)."""
    text = raw.decode("utf-8", "replace")
    signature, _, body = text.partition("\n")
    if not hmac.compare_digest(signature, _signature(body)):
        return None
    parts = body.split("\n", 2)
    if len(parts) != 3 or len(parts[2]) > _MESSAGE_CHARS:
        return None
    rank, stage = _number(parts[0]), _number(parts[1])
    world = dist.get_world_size() if dist.is_initialized() else None
    if rank is None or (world is not None and rank >= world):
        return None
    if stage is None and parts[1] != "None":
        return None
    return rank, stage, parts[2]


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
    ours = _record(rank, stage, message)
    try:
        first = store.compare_set(_KEY, "", ours)
        if first != ours.encode() and _parsed(first) is None:  # no rank's: take its place
            # the bytes as stored (any, not only UTF-8); pybind takes bytes for a string
            first = store.compare_set(_KEY, first, ours)  # type: ignore[arg-type]
    except RuntimeError:  # the store itself is gone: the local error stands
        return PipelineError(message, rank, stage)
    found = _parsed(first)
    if first == ours.encode() or found is None:
        return PipelineError(message, rank, stage)
    return _from_record(rank, stage, found)


def _from_record(
    rank: int, stage: int | None, record: tuple[int, int | None, str]
) -> PipelineError:
    origin_rank, origin_stage, message = record
    where = "" if origin_stage is None else f" (stage {origin_stage})"
    return PipelineError(
        f"rank {rank} (stage {stage}) stopped because rank {origin_rank}{where} "
        f"failed first: {message}",
        origin_rank,
        origin_stage,
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
            origin = _parsed(store.get(_KEY)) if store.check([_KEY]) else None
        except RuntimeError:
            origin = None
    if origin is not None:
        return _from_record(rank, stage, origin)
    return PipelineError(f"rank {rank} (stage {stage}) stopped: {detail}", None, None)
