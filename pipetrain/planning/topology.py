"""Network topology: levels of components joined by links of one bandwidth and latency each.

Level 0 groups ``count`` workers (for example the GPUs of a server) over links of its
bandwidth; level 1 groups ``count`` level-0 components (servers) over its own links; and so
on, as in PipeDream's hierarchical planner. Workers are numbered so that each component
holds consecutive ranks.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cached_property

SYNTAX = (
    "COUNTxBANDWIDTH[@LATENCY] per level, lowest level first, separated by commas, "
    'e.g. "4x16GB/s,4x10Gbit/s" or "4x100Mbit/s@200us"; units B/s (bytes) or b/s, bit/s, '
    'bps (bits), with an optional k, M, G or T prefix (powers of 1000); "infB/s" for no '
    "limit; a latency (the fixed time of one message over the link) in s, ms or us"
)
"""The syntax :meth:`Topology.parse` accepts, quoted in its error messages."""

_PREFIXES = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_LEVEL = re.compile(
    r"^\s*(?P<count>\d+)\s*[x×*]\s*(?P<value>inf|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)\s*"
    r"(?P<prefix>[kKMGT]?)(?P<unit>B/s|bit/s|b/s|bps)\s*"
    r"(?:@\s*(?P<latency>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)\s*(?P<time>s|ms|us))?\s*$"
)
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


@dataclass(frozen=True)
class Level:
    """``count`` components of the level below, joined by links of ``bandwidth`` bytes/s
    over which one message takes ``latency_s`` besides its bytes (on a network: the
    transport's per-message round trips and the switches' delay)."""

    count: int
    bandwidth: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        """Reject counts below 1 and non-positive bandwidths."""
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"a topology level needs a count >= 1, got {self.count!r}")
        if (
            not isinstance(self.bandwidth, (int, float))
            or math.isnan(self.bandwidth)
            or self.bandwidth <= 0
        ):
            raise ValueError(
                f"a topology level needs a bandwidth > 0 bytes/s, got {self.bandwidth!r}"
            )
        if (
            not isinstance(self.latency_s, (int, float))
            or not math.isfinite(self.latency_s)
            or self.latency_s < 0
        ):
            raise ValueError(
                f"a topology level needs a finite latency >= 0 s, got {self.latency_s!r}"
            )


@dataclass(frozen=True)
class Topology:
    """Hierarchical network: ``levels[0]`` is the lowest (fastest, usually) level."""

    levels: tuple[Level, ...]

    def __init__(self, levels: list[Level] | tuple[Level, ...]) -> None:
        """Build a topology from its levels, lowest first."""
        levels = tuple(levels)
        if not levels or not all(isinstance(level, Level) for level in levels):
            raise ValueError(f"a Topology needs at least one Level, got {levels!r}")
        object.__setattr__(self, "levels", levels)

    @classmethod
    def flat(cls, workers: int, bandwidth: float = math.inf, latency_s: float = 0.0) -> Topology:
        """One level: ``workers`` workers, every pair joined at ``bandwidth`` bytes/s, each
        message taking ``latency_s`` besides its bytes."""
        return cls([Level(workers, bandwidth, latency_s)])

    @classmethod
    def parse(cls, text: str) -> Topology:
        """Parse ``"4x16GB/s,4x10Gbit/s"`` or ``"4x100Mbit/s@200us"`` (see :data:`SYNTAX`)."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"cannot parse topology {text!r}; expected {SYNTAX}")
        levels = []
        for part in text.split(","):
            match = _LEVEL.match(part)
            if match is None:
                raise ValueError(
                    f"cannot parse topology {text!r} at {part.strip()!r}; expected {SYNTAX}"
                )
            bits = match["unit"] != "B/s"
            bandwidth = float(match["value"]) * _PREFIXES[match["prefix"]] / (8 if bits else 1)
            latency = (
                0.0
                if match["latency"] is None
                else float(match["latency"]) * _TIME_UNITS[match["time"]]
            )
            try:
                levels.append(Level(int(match["count"]), bandwidth, latency))
            except ValueError as error:
                raise ValueError(f"cannot use topology {text!r}: {error}") from None
        return cls(levels)

    @property
    def workers(self) -> int:
        """Total number of workers: the product of the level counts."""
        return math.prod(level.count for level in self.levels)

    def component_size(self, level: int) -> int:
        """Workers in one component of ``level`` (level 0: ``levels[0].count``)."""
        return math.prod(self.levels[k].count for k in range(level + 1))

    def span_bandwidth(self, first: int, last: int) -> float:
        """Bandwidth of the slowest link inside the ranks ``first..last`` (inclusive).

        That is the bandwidth of the lowest level whose component holds both ranks;
        ``inf`` when ``first == last`` (nothing crosses a link).
        """
        if first == last:
            self._joining_level(first, last)  # checks the ranks
            return math.inf
        return min(level.bandwidth for level in self.levels[: self._joining_level(first, last) + 1])

    def span_latency(self, first: int, last: int) -> float:
        """Latency of one message between the ranks ``first`` and ``last``: the largest
        among the levels up to the lowest one whose component holds both; 0 when
        ``first == last``."""
        if first == last:
            self._joining_level(first, last)  # checks the ranks
            return 0.0
        return max(level.latency_s for level in self.levels[: self._joining_level(first, last) + 1])

    def _joining_level(self, first: int, last: int) -> int:
        """The lowest level whose component holds both ranks; ValueError for a rank outside."""
        for rank in (first, last):
            if not 0 <= rank < self._component_sizes[-1]:  # the workers
                raise ValueError(f"rank {rank} is outside this topology's {self.workers} workers")
        low, high = min(first, last), max(first, last)
        for level, size in enumerate(self._component_sizes):
            if low // size == high // size:
                return level
        raise AssertionError("the top level holds every rank")

    @cached_property
    def _component_sizes(self) -> tuple[int, ...]:
        """:meth:`component_size` of every level (the planner asks for spans by the thousand)."""
        return tuple(self.component_size(level) for level in range(len(self.levels)))

    def __str__(self) -> str:
        """The topology in :meth:`parse` syntax."""
        return ",".join(
            f"{level.count}x{_format_bandwidth(level.bandwidth)}"
            + (f"@{level.latency_s * 1e6:.6g}us" if level.latency_s else "")
            for level in self.levels
        )


def resolve(topology: Topology | str | None, workers: int | None) -> Topology:
    """The topology to plan for, from a Topology, a string, or a worker count alone.

    With no topology, ``workers`` workers share one infinitely fast level. With both, the
    counts must agree.
    """
    if isinstance(topology, str):
        topology = Topology.parse(topology)
    if topology is None:
        if workers is None:
            raise ValueError(
                'give workers (e.g. workers=8) or a topology (e.g. topology="2x16GB/s,4x10Gbit/s")'
            )
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive integer, got {workers!r}")
        return Topology.flat(workers)
    if not isinstance(topology, Topology):
        raise TypeError(
            'topology must be a Topology or a string such as "4x16GB/s,4x10Gbit/s", '
            f"got {topology!r}"
        )
    if workers is not None and workers != topology.workers:
        raise ValueError(
            f"workers={workers} does not match topology {topology} with {topology.workers} "
            "workers; leave workers out or make the level counts multiply to it"
        )
    return topology


def _format_bandwidth(bandwidth: float) -> str:
    """Bytes/s as the shortest readable ``GB/s``-style string."""
    if math.isinf(bandwidth):
        return "infB/s"
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if bandwidth >= scale:
            return f"{bandwidth / scale:.12g}{prefix}B/s"
    return f"{bandwidth:.12g}B/s"
