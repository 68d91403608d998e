"""One run per checkpoint directory: a lock file naming the run that saves there.

The first save of a run into a root writes ``ROOT/.lock``, a JSON object with the saving
process's host, pid, the time it took the lock and a token unique to the run (which names
the run's temporary directories). A second run that saves there while the owner lives is
refused, naming the owner; a lock whose owner has died on this host (or whose pid now
belongs to a process started after the lock) is taken over. The owner removes the lock when
its process exits.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any

LOCK = ".lock"
_ATTEMPTS = 5
_START_SLACK_S = 1.0  # /proc start times are in clock ticks; allow for their rounding


class DirectoryLocked(RuntimeError):
    """Another live run saves into the directory; the message names its host and pid."""


def acquire(root: str | os.PathLike) -> str:
    """Take ``root``'s lock for this process (or keep it, if it holds it already) and return
    the run's token.

    Raises:
        DirectoryLocked: another run that is alive, or on another host, holds it.
    """
    path = Path(root) / LOCK
    for _ in range(_ATTEMPTS):
        mine = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            "token": f"{os.getpid()}-{secrets.token_hex(4)}",
        }
        if _create(path, mine):
            atexit.register(release, root)
            return str(mine["token"])
        owner = _read(path)
        if owner is not None and _is_mine(owner):
            return str(owner["token"])
        if owner is not None and not _dead(owner):
            raise DirectoryLocked(_refusal(path, owner))
        _break(path, owner)
    raise DirectoryLocked(f"could not take the lock {path}: other runs keep replacing it")


def _create(path: Path, fields: dict[str, Any]) -> bool:
    """Write the lock at ``path`` whole, unless one exists; whether it was written."""
    written = path.with_name(f"{LOCK}.{fields['token']}.tmp")
    with open(written, "w", encoding="utf-8") as file:
        file.write(json.dumps(fields))
        file.flush()
        os.fsync(file.fileno())
    try:
        os.link(written, path)  # atomic and exclusive: the lock appears complete or not at all
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links: create exclusively, then write
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(json.dumps(fields))
    finally:
        written.unlink()
    return True


def token(root: str | os.PathLike) -> str | None:
    """The token of the run holding ``root``'s lock; ``None`` if none holds it."""
    owner = _read(Path(root) / LOCK)
    return None if owner is None else str(owner["token"])


def release(root: str | os.PathLike) -> None:
    """Remove ``root``'s lock if this process holds it."""
    path = Path(root) / LOCK
    owner = _read(path)
    if owner is not None and _is_mine(owner):
        path.unlink(missing_ok=True)


def _read(path: Path) -> dict[str, Any] | None:
    """The lock's fields; ``None`` if there is no lock or the file is not one."""
    try:
        with open(path, encoding="utf-8") as file:
            owner = json.loads(file.read(4096))
    except (OSError, ValueError):  # none, or not a lock
        return None
    fields: dict[str, type | tuple[type, ...]] = {
        "host": str,
        "pid": int,
        "started": (int, float),
        "token": str,
    }
    if not isinstance(owner, dict) or any(
        not isinstance(owner.get(key), kind) for key, kind in fields.items()
    ):
        return None
    return owner


def _is_mine(owner: dict[str, Any]) -> bool:
    return bool(owner["host"] == socket.gethostname() and owner["pid"] == os.getpid())


def _dead(owner: dict[str, Any]) -> bool:
    """Whether the lock's owner has certainly ended: only known on its own host."""
    if owner["host"] != socket.gethostname():
        return False
    pid = owner["pid"]
    stat = Path(f"/proc/{pid}/stat")
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    if fields[0] == "Z":  # ended, not yet reaped
        return True
    return _started(int(fields[19])) > owner["started"] + _START_SLACK_S  # a reused pid


def _started(ticks: int) -> float:
    """The wall-clock time of a process start given in clock ticks since boot."""
    boot = next(
        float(line.split()[1])
        for line in Path("/proc/stat").read_text().splitlines()
        if line.startswith("btime ")
    )
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _break(path: Path, owner: dict[str, Any] | None) -> None:
    """Remove a dead owner's (or a torn) lock, putting it back if another run took the lock
    meanwhile."""
    aside = path.with_name(f"{LOCK}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    if _read(aside) != owner:  # another run's fresh lock: give it back
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
    aside.unlink(missing_ok=True)


def _refusal(path: Path, owner: dict[str, Any]) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner["started"]))
    where = "this host" if owner["host"] == socket.gethostname() else f"host {owner['host']}"
    return (
        f"{path.parent} is in use by another run: pid {owner['pid']} on {where} "
        f"({owner['host']}), saving there since {started}; give this run another directory, "
        f"or delete {path} if that run has ended"
    )
