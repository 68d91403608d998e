"""The :class:`Schedule` value and its text form.

A schedule is plain data. The validator, the simulator and the runtime all read the same
value, so a predicted timeline and a measured one describe the same actions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

from pipetrain.schedules.actions import COMPUTE_KINDS, WRITTEN_KINDS, Action, Kind
from pipetrain.schedules.errors import ScheduleError
from pipetrain.schedules.lower import full_backwards, lower
from pipetrain.schedules.messages import rank_of
from pipetrain.schedules.overlap import check_pairs
from pipetrain.schedules.residency import host_stored
from pipetrain.schedules.validate import validate


@dataclass(frozen=True)
class Schedule:
    """Every rank's ordered actions for one training step (or one window of async steps).

    ``stages`` counts model stages and ``num_ranks`` ranks (worker processes); a rank may
    hold several stages (interleaved chunks). ``stage_ranks[s]`` lists the ranks that hold
    stage ``s``; a stage on more than one rank is replicated and micro-batch ``k`` of it
    runs on ``stage_ranks[s][k % replicas]``. ``microbatches`` counts every micro-batch the
    schedule runs (for ``2bw``, those of all its updates). ``options`` holds the facts the
    validator checks (``max_versions``, ``vertical_sync``) and the builder's options.
    """

    name: str
    stages: int
    microbatches: int
    ranks: tuple[tuple[Action, ...], ...]
    stage_ranks: tuple[tuple[int, ...], ...]
    split_backward: bool = False
    asynchronous: bool = False
    options: Mapping[str, object] = field(default_factory=dict, compare=False)

    @cached_property
    def overlapped(self) -> tuple[dict[int, int], ...]:
        """Per rank, the index of each overlapped pair's backward -> its forward's (see
        :mod:`~pipetrain.schedules.overlap`); raises :class:`ScheduleError` where a marker
        breaks the rule. Found once: the validator and the simulator both read it."""
        return check_pairs(self.ranks)

    @cached_property
    def host_stored(self) -> bool:
        """Whether its weights live in a host store, loaded and offloaded by its ranks (any
        ``LOAD`` or ``OFFLOAD``; see :mod:`~pipetrain.schedules.residency`). Found once: the
        validator, the simulator and the runtime's refusal all read it."""
        return host_stored(self.ranks)

    @property
    def num_ranks(self) -> int:
        """How many ranks (worker processes) the schedule needs."""
        return len(self.ranks)

    def rank_of(self, stage: int, microbatch: int) -> int:
        """The rank that runs ``microbatch`` of ``stage`` (round-robin over replicas)."""
        return rank_of(self.stage_ranks, stage, microbatch)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages a rank holds, in increasing order."""
        return tuple(s for s, ranks in enumerate(self.stage_ranks) if rank in ranks)

    def compute_order(self, rank: int) -> list[str]:
        """The rank's compute actions as short strings, for reading and tests."""
        return [str(a) for a in self.ranks[rank] if a.kind in COMPUTE_KINDS]

    def describe(self) -> str:
        """The schedule as text: a header, the placement, and every rank's written actions.

        Sends, receives and the loss all-reduce are left out: the lowering pass derives
        them, so :meth:`from_text` of this text gives this schedule back.
        """
        flags = [flag for flag in ("split_backward", "asynchronous") if getattr(self, flag)]
        options = [f"{key}={_option_text(value)}" for key, value in sorted(self.options.items())]
        lines = [
            f"schedule {self.name}: {self.stages} stages on {self.num_ranks} ranks, "
            f"{self.microbatches} micro-batches",
            "placement: " + " ".join(",".join(map(str, ranks)) for ranks in self.stage_ranks),
        ]
        if flags or options:
            lines.append("facts: " + " ".join(flags + options))
        for rank, actions in enumerate(self.ranks):
            written = " ".join(str(a) for a in actions if a.kind in WRITTEN_KINDS)
            lines.append(f"rank {rank}: {written}")
        return "\n".join(lines)

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        """Read a schedule written as :meth:`describe` writes it, add its communication
        (:func:`~pipetrain.schedules.lower.lower`), and validate it.

        Only the ``rank R: ...`` lines are required; blank lines and lines starting with
        ``#`` are skipped. Without a header the name is ``custom`` and the stage and
        micro-batch counts are the highest named plus one; without ``placement`` each stage
        is held by the ranks whose actions name it; ``facts`` default to a split backward if
        any ``W`` appears and asynchronous if any action names a version.
        """
        header, placement, facts, orders = _read_lines(text)
        written = [action for order in orders for action in order]
        stages = header[1] if header else 1 + max((a.stage for a in written), default=-1)
        microbatches = (
            header[3] if header else 1 + max((a.microbatch or 0 for a in written), default=0)
        )
        if max(stages, microbatches) > len(written):  # before anything is sized by them
            _check_counts(stages, microbatches, written)
        if placement is None:
            holders: dict[int, set[int]] = {}
            for rank, order in enumerate(orders):
                for action in order:
                    holders.setdefault(action.stage, set()).add(rank)
            placement = tuple(tuple(sorted(holders.get(s, ()))) for s in range(stages))
        if len(placement) != stages:
            raise ScheduleError(
                f"placement lists {len(placement)} stages, but the schedule has {stages}"
            )
        unheld = [stage for stage, ranks in enumerate(placement) if not ranks]
        if unheld:
            raise ScheduleError(
                f"stage {unheld[0]} is held by no rank: give it actions or a 'placement:' line"
            )
        _check_counts(stages, microbatches, written)
        flags, options = facts
        if flags is None:
            flags = {"split_backward"} if any(a.kind is Kind.WEIGHT for a in written) else set()
            if any(a.version is not None for a in written):
                flags.add("asynchronous")
        schedule = cls(
            name=header[0] if header else "custom",
            stages=stages,
            microbatches=microbatches,
            ranks=lower(orders, placement, full_backwards=full_backwards(options)),
            stage_ranks=placement,
            split_backward="split_backward" in flags,
            asynchronous="asynchronous" in flags,
            options=options,
        )
        validate(schedule)
        return schedule


def _check_counts(stages: int, microbatches: int, written: list[Action]) -> None:
    """Refuse stage and micro-batch counts that the written forwards cannot cover (each
    micro-batch needs a forward on each stage), before the validator's tables are sized by
    them: what reading a schedule costs then follows the length of its text, not its
    numbers."""
    forwards = sum(1 for action in written if action.kind is Kind.FORWARD)
    if stages * microbatches > forwards:
        raise ScheduleError(
            f"the schedule has {stages} stages and {microbatches} micro-batches, so it needs "
            f"{stages * microbatches} forwards (each micro-batch on each stage), but "
            f"{forwards} are written; number stages and micro-batches from 0 without gaps"
        )


def _option_text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


_HEADER = re.compile(r"^schedule (\S+): (\d+) stages on (\d+) ranks, (\d+) micro-batches$")
_RANK = re.compile(r"^rank (\d+):(.*)$")

Header = tuple[str, int, int, int] | None  # name, stages, ranks, micro-batches
Facts = tuple[set[str] | None, dict[str, object]]


def _read_lines(
    text: str,
) -> tuple[Header, tuple[tuple[int, ...], ...] | None, Facts, list[list[Action]]]:
    """The header, placement, facts and per-rank written actions of a schedule's text."""
    header: Header = None
    placement: tuple[tuple[int, ...], ...] | None = None
    facts: Facts = (None, {})
    lanes: dict[int, list[Action]] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            if match := _HEADER.match(line):
                name, stages, ranks, microbatches = match.groups()
                header = (name, int(stages), int(ranks), int(microbatches))
            elif line.startswith("placement:"):
                placement = tuple(
                    tuple(int(r) for r in part.split(",")) for part in line[10:].split()
                )
            elif line.startswith("facts:"):
                facts = _read_facts(line[6:].split())
            elif match := _RANK.match(line):
                lanes[int(match.group(1))] = _read_actions(match.group(2).split())
            else:
                raise ValueError(
                    "expected 'schedule NAME: S stages on R ranks, M micro-batches', "
                    "'placement: ...', 'facts: ...' or 'rank R: actions'"
                )
        except ValueError as error:
            raise ScheduleError(f"line {number}: {raw.strip()!r}: {error}") from None
    if sorted(lanes) != list(range(len(lanes))) or not lanes:
        raise ScheduleError(
            f"the text must have lines 'rank 0:' to 'rank N:', got ranks {sorted(lanes)}"
        )
    if header is not None and header[2] != len(lanes):
        raise ScheduleError(
            f"the header says {header[2]} ranks, but {len(lanes)} rank lines follow"
        )
    return header, placement, facts, [lanes[r] for r in range(len(lanes))]


def _read_actions(words: list[str]) -> list[Action]:
    actions = [Action.parse(word) for word in words]
    derived = [a for a in actions if a.kind not in WRITTEN_KINDS]
    if derived:
        raise ValueError(
            f"{derived[0]} is derived by the lowering pass; write only "
            f"{', '.join(sorted(k.value for k in WRITTEN_KINDS))} actions"
        )
    return actions


def _read_facts(words: list[str]) -> Facts:
    flags: set[str] = set()
    options: dict[str, object] = {}
    for word in words:
        if "=" not in word:
            if word not in ("split_backward", "asynchronous"):
                raise ValueError(
                    f"unknown fact {word!r}: use split_backward, asynchronous or key=value"
                )
            flags.add(word)
            continue
        key, value = word.split("=", 1)
        options[key] = {"true": True, "false": False}.get(
            value, int(value) if value.isdigit() else value
        )
    return flags, options
