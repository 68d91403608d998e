"""A worker ends without finalizing the interpreter, so that gloo's threads, which let go of
a finished collective's tensors a moment after the caller's wait returns, cannot abort a
finished run (SIGABRT as they take the GIL from a finalizing interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_cli import ROOT

from pipetrain.app import cli
from pipetrain.distributed.parent import AGENT_ENV

ENDING = """
import atexit
import sys
from pipetrain.distributed.parent import exit_now


class Collected:
    def __del__(self) -> None:
        print(" collected", end="")


kept = Collected()  # collected only when the interpreter finalizes
atexit.register(print, " exit handler ran", end="")
print("written", end="")  # still in stdout's buffer: a pipe is not a terminal
{ending}
"""


@pytest.mark.parametrize(
    "ending, printed",
    [
        ("exit_now(3)", "written exit handler ran"),
        # the reference: a plain exit finalizes, which collects the module's objects
        ("sys.exit(3)", "written exit handler ran collected"),
    ],
)
def test_exit_now_runs_the_exit_handlers_and_flushes_but_does_not_finalize(
    ending: str, printed: str
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", ENDING.format(ending=ending)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert (done.returncode, done.stdout) == (3, printed), done.stderr


class _Ended(Exception):
    """What the stand-in for ``exit_now`` raises: the process would have ended there."""


@pytest.mark.parametrize("under_torchrun", [True, False])
def test_the_command_ends_a_torchrun_worker_through_exit_now(
    under_torchrun: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    ended: list[int] = []

    def exit_now(status: int) -> None:
        ended.append(status)
        raise _Ended

    monkeypatch.setattr(cli, "main", lambda: 2)
    monkeypatch.setattr(cli, "exit_now", exit_now)
    if under_torchrun:
        monkeypatch.setenv(AGENT_ENV, "a-run")
        with pytest.raises(_Ended):
            cli.entry()
        assert ended == [2]
    else:
        monkeypatch.delenv(AGENT_ENV, raising=False)
        with pytest.raises(SystemExit) as exited:
            cli.entry()
        assert (exited.value.code, ended) == (2, [])
