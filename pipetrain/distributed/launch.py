"""Start local worker processes in a gloo (or NCCL) process group, for quick runs and tests.

No worker outlives the launcher: SIGINT, SIGTERM or SIGHUP of the launcher stops every
worker before the launcher ends, and a worker whose launcher died (even by SIGKILL) ends
at once (Linux) or within a quarter of a second (elsewhere). Workers report through pipes,
not multiprocessing queues, so a launcher killed outright leaves no semaphore behind. The
store and the workers' gloo sockets listen on loopback only, and the workers sign the
failure records they leave in the store with a key that reaches them through their pipe.
"""

from __future__ import annotations

import io
import math
import multiprocessing as mp
import os
import secrets
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.distributed.failure import sign_records
from pipetrain.distributed.heap import keep_freed_memory
from pipetrain.distributed.heartbeat import stop_beating
from pipetrain.distributed.io_threads import defer_gloo_io_threads
from pipetrain.distributed.parent import end_with_parent, exit_now
from pipetrain.distributed.store import LOOPBACK, keep_gloo_on_loopback, local_store

_STOP_GRACE_S = 3.0  # a stopped worker's time to end on SIGTERM before SIGKILL
_ORIGIN_GRACE_S = 1.0  # a worker another names as the origin of a failure: its time to report
_FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP")


class LaunchError(RuntimeError):
    """A worker failed; the message is that of the rank where the failure began."""

    def __init__(self, message: str, rank: int, worker_traceback: str) -> None:
        """Keep the failing rank and its traceback."""
        super().__init__(message)
        self.rank, self.worker_traceback = rank, worker_traceback


def _worker(
    parent: int,
    rank: int,
    nprocs: int,
    port: int,
    backend: str,
    timeout_s: float,
    threads: int,
    results: Connection,
    fn: Callable,
    args: tuple,
    secret: str,
) -> None:
    end_with_parent(parent)
    keep_freed_memory()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        MASTER_ADDR=LOOPBACK,
        MASTER_PORT=str(port),
    )
    keep_gloo_on_loopback()  # every worker runs on this host
    sign_records(secret)  # given through the pipe, never the store: no one else can sign
    torch.set_num_threads(threads)
    status = 0
    try:
        store = dist.TCPStore(
            LOOPBACK, port, nprocs, is_master=False, timeout=timedelta(seconds=timeout_s)
        )
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=nprocs, timeout=timedelta(seconds=timeout_s)
        )
        defer_gloo_io_threads()
        result = fn(*args)
        # as bytes: tensors shared through file descriptors would die with this process
        payload = io.BytesIO()
        torch.save(result, payload)
        results.send((True, payload.getvalue(), ""))
        stop_beating()
        dist.destroy_process_group()
    except BaseException as error:  # reported to the parent, which raises it
        origin = getattr(error, "origin_rank", rank)
        results.send((False, (f"{type(error).__name__}: {error}", origin), traceback.format_exc()))
        status = 1
    exit_now(status)  # gloo's threads may still hold the last collective's tensors


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    threads_per_worker: int | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` in ``nprocs`` new processes forming one process group; return their
    results by rank.

    ``fn`` must be importable (defined at module level). If any worker raises, the others
    are given ``timeout_s`` to stop, then ended, and a :class:`LaunchError` carries the
    message of the rank where the failure began (a worker that the others name as frozen
    gets one second, then is ended). Every collective and receive times out after
    ``timeout_s``. SIGINT, SIGTERM or SIGHUP of this process (in the main thread)
    stops every worker before it takes effect, and workers end when this process dies.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
    threads = threads_per_worker or max(1, (os.cpu_count() or 1) // nprocs)
    store = local_store(nprocs, timedelta(seconds=timeout_s))  # on loopback only
    secret = secrets.token_hex(16)
    context = mp.get_context("spawn")
    pipes = [context.Pipe(duplex=False) for _ in range(nprocs)]
    workers = [
        context.Process(
            target=_worker,
            args=(
                os.getpid(),
                rank,
                nprocs,
                store.port,
                backend,
                timeout_s,
                threads,
                pipes[rank][1],
                fn,
                args,
                secret,
            ),
            daemon=True,
        )
        for rank in range(nprocs)
    ]
    outcomes: dict[int, tuple] = {}
    try:
        with _signals_stop(workers):
            for worker, (_, sending) in zip(workers, pipes):
                worker.start()
                sending.close()  # the worker's end: a worker that dies closes the last copy
            _collect(workers, [receiving for receiving, _ in pipes], outcomes, timeout_s)
    except BaseException:
        _stop(workers)  # interrupted: the workers must not go on without the launcher
        raise
    finally:
        _stop([worker for rank, worker in enumerate(workers) if rank not in outcomes])
        for worker in workers:
            if worker.pid is None:
                continue  # never started
            worker.join(timeout=5)
            if worker.is_alive():
                worker.kill()
                worker.join()
        for receiving, _ in pipes:
            receiving.close()
    failures = {rank: outcome for rank, outcome in outcomes.items() if not outcome[0]}
    if failures or len(outcomes) < nprocs:
        if not failures:
            raise LaunchError(
                f"workers {sorted(set(range(nprocs)) - set(outcomes))} did not finish", -1, ""
            )
        origin, message, trace = _origin(failures)
        raise LaunchError(f"worker rank {origin} failed: {message}", origin, trace)
    return [torch.load(io.BytesIO(outcomes[rank][1]), weights_only=False) for rank in range(nprocs)]


def _collect(
    workers: Sequence[mp.process.BaseProcess],
    pipes: Sequence[Connection],
    outcomes: dict[int, tuple],
    timeout_s: float,
) -> None:
    """Fill ``outcomes`` (rank: ``(ok, value, traceback)``) from the workers' reports and
    ends; after the first failure, the others have ``timeout_s`` to report, and a worker
    that another names as the failure's origin (a frozen one) only a moment."""
    open_pipes = dict(zip(pipes, range(len(pipes))))
    silent: set[int] = set()  # ranks whose pipe closed without a report
    deadline = None
    while len(outcomes) < len(workers):
        for ready in wait(list(open_pipes), timeout=0.2):
            assert isinstance(ready, Connection)  # only connections are waited on
            rank = open_pipes.pop(ready)
            try:
                outcomes[rank] = ready.recv()
            except EOFError:
                silent.add(rank)
        for rank in sorted(silent - set(outcomes)):
            if not workers[rank].is_alive():
                outcomes[rank] = (False, (_ended(workers[rank].exitcode), rank), "")
        failures = [value for ok, value, _ in outcomes.values() if not ok]
        if failures and deadline is None:
            deadline = time.monotonic() + timeout_s
        if any(origin not in outcomes for _, origin in failures if origin is not None):
            deadline = min(deadline or math.inf, time.monotonic() + _ORIGIN_GRACE_S)
        if deadline is not None and time.monotonic() > deadline:
            return


def _origin(failures: dict[int, tuple]) -> tuple[int, str, str]:
    """The rank where a failure began, its message and its traceback: a worker that died
    without a word (a signal, a crash), which broke its peers' connections; else the first
    origin a failure names, its own report if it made one (else the namer's: it froze);
    else the lowest rank."""
    died = [rank for rank, (_, _, trace) in failures.items() if not trace]
    if died:
        return died[0], failures[died[0]][1][0], ""
    named = [(value[1], rank) for rank, (_, value, _) in failures.items() if value[1] is not None]
    reported = [(origin, origin) for origin, _ in named if origin in failures]
    origin, reporter = (reported or named or [(min(failures), min(failures))])[0]
    return origin, failures[reporter][1][0], failures[reporter][2]


def _ended(exitcode: int | None) -> str:
    """How a worker that reported nothing ended."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"worker was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            pass
    return f"worker exited with code {exitcode}"


def _stop(workers: Sequence[mp.process.BaseProcess]) -> None:
    """Terminate the started ``workers``; kill those still alive after a short grace."""
    started = [worker for worker in workers if worker.pid is not None and worker.is_alive()]
    for worker in started:
        worker.terminate()
        with suppress(ProcessLookupError):  # a stopped worker acts on SIGTERM once continued
            os.kill(worker.pid, signal.SIGCONT)  # type: ignore[arg-type]  # started: has a pid
    deadline = time.monotonic() + _STOP_GRACE_S
    for worker in started:
        worker.join(timeout=max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            worker.kill()
            worker.join()


@contextmanager
def _signals_stop(workers: Sequence[mp.process.BaseProcess]) -> Iterator[None]:
    """While inside, SIGINT, SIGTERM and SIGHUP of this process stop ``workers`` first.

    A signal with a handler of the caller's still reaches that handler (SIGINT's default
    one raises KeyboardInterrupt); one whose default action would end the process raises
    ``SystemExit(128 + signal)`` instead, so the launcher ends as before but cleanly. Only
    the main thread can handle signals; elsewhere nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, Any] = {}

    def stop(signum: int, frame: FrameType | None) -> None:
        _stop(workers)
        handler = previous[signum]
        if callable(handler):
            handler(signum, frame)
            return
        raise SystemExit(128 + signum)

    for name in _FORWARDED:
        number = getattr(signal, name, None)
        if number is not None and signal.getsignal(number) not in (signal.SIG_IGN, None):
            previous[number] = signal.signal(number, stop)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
