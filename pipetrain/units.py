"""Seconds, bytes and bandwidths as people read and write them.

Formatting for reports (``"35.7 ms"``, ``"1.5 GB"``, ``"16GB/s"``) and parsing of the sizes
and bandwidths that users type (``"16GiB"``, ``"10Gbit/s"``). Decimal prefixes (k, M, G, T)
are powers of 1000; ``i`` after a prefix (``GiB``) makes it a power of 1024.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

_DECIMAL = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))
_POWERS = {"": 0, "k": 1, "K": 1, "M": 2, "G": 3, "T": 4}
_NUMBER = r"\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?"
_SIZE = re.compile(rf"^\s*(?P<number>{_NUMBER})\s*(?:(?P<prefix>[kKMGT])(?P<binary>i?))?B?\s*$")
_BANDWIDTH = re.compile(
    rf"^\s*(?P<number>inf|{_NUMBER})\s*(?P<prefix>[kKMGT]?)(?P<unit>B/s|bit/s|b/s|bps)\s*$"
)


def time_unit(seconds: float) -> tuple[float, str]:
    """The factor from seconds and the unit name (s, ms or µs) that suit ``seconds``."""
    if seconds >= 1.0 or seconds == 0.0:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def format_seconds(seconds: float) -> str:
    """``seconds`` in a readable unit, such as ``"35.7 ms"``."""
    factor, unit = time_unit(seconds)
    return f"{seconds * factor:.4g} {unit}"


def format_bytes(size: float) -> str:
    """A byte count with a decimal unit, such as ``"1.5 GB"`` or ``"512 B"``."""
    for prefix, scale in _DECIMAL:
        if size >= scale:
            return f"{size / scale:.4g} {prefix}B"
    return f"{size:.4g} B"


def format_bandwidth(bytes_per_s: float) -> str:
    """Bytes/s as the shortest exact ``"16GB/s"``-style string; :func:`parse_bandwidth` reads
    it back to the same value (``"infB/s"`` for no limit)."""
    if math.isinf(bytes_per_s):
        return "infB/s"
    for prefix, scale in _DECIMAL:
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.12g}{prefix}B/s"
    return f"{bytes_per_s:.12g}B/s"


def parse_bytes(text: str) -> float:
    """``"16GiB"`` -> 17179869184, ``"500MB"`` -> 5e8, ``"1024"`` -> 1024; ValueError otherwise."""
    match = _SIZE.match(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(
            f"memory size {text!r} is not a size; write it like 16GiB, 500MB or 1e9 (bytes)"
        )
    base = 1024 if match["binary"] else 1000
    return float(match["number"]) * base ** _POWERS[match["prefix"] or ""]


def parse_bandwidth(text: str) -> float:
    """Bytes/s from ``"16GB/s"`` (bytes) or ``"10Gbit/s"``, ``"10Gb/s"``, ``"10Gbps"`` (bits);
    ``"infB/s"`` is no limit. ValueError for anything else."""
    match = _BANDWIDTH.match(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(
            f"bandwidth {text!r} is not a bandwidth; write it like 16GB/s, 10Gbit/s or infB/s"
        )
    per_byte = 1 if match["unit"] == "B/s" else 8  # every other unit counts bits
    return float(match["number"]) * 1000 ** _POWERS[match["prefix"]] / per_byte


def abbreviated(values: Sequence[object], most: int = 8) -> str:
    """``values`` as a list for a message: all of them if there are at most ``most``, else
    the first ``most`` and how many more, so that a message stays one short line."""
    if len(values) <= most:
        return f"[{', '.join(map(str, values))}]"
    return f"[{', '.join(map(str, values[:most]))}, ... {len(values) - most:,} more]"


def counted(number: int, singular: str, plural: str | None = None) -> str:
    """``"1 stage"``, ``"2 stages"``; ``plural`` where adding an s is wrong."""
    return f"{number} {singular if number == 1 else plural or singular + 's'}"
