"""Why the planner passed over each schedule it considered: it could run no layout tried,
it did not fit in memory, or it fitted and was slower than the plan chosen (or not enough
faster to beat its fewer stages or micro-batches). The same for the two ways of replicating
a stage, whole copies and shards (``replicated`` and ``sharded`` layouts)."""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.planning.candidates import Candidate
from pipetrain.units import format_bytes


@dataclass
class _Record:
    """What the planner saw of one schedule."""

    runnable: bool = False
    over_limit: tuple[float, Candidate] | None = None  # the smallest peak that did not fit
    fitting: tuple[float, Candidate] | None = None  # the smallest peak that fitted
    ceiling: float = 0.0  # the best throughput bound among those that fitted
    ruled_out: float = 0.0  # the best ceiling of those a close bound ruled out unsimulated
    simulated: float = 0.0  # the best simulated throughput
    host_over: tuple[float, float] | None = None  # a host store's bytes over the host limit


LAYOUT_KINDS = ("replicated", "sharded")
"""The layouts with replicated stages, by what each replica holds: whole copies or shards."""


def _layout_kind(candidate: Candidate) -> str | None:
    """``replicated`` or ``sharded`` for a layout with a replicated stage, else ``None``."""
    layout = candidate.layout
    if layout.virtual > 1 or max(layout.replicas) < 2:
        return None
    return LAYOUT_KINDS[layout.shard]


class Verdicts:
    """Per schedule, the configurations the planner tried and how each fared."""

    def __init__(self, schedules: tuple[str, ...]) -> None:
        """Start with nothing seen of each of ``schedules``."""
        self._records = {name: _Record() for name in schedules}
        self._layouts = {name: _Record() for name in LAYOUT_KINDS}
        self._chosen_throughput = 0.0

    def chose(self, throughput: float) -> None:
        """The plan chosen was simulated at ``throughput`` samples per second (a faster
        schedule can lose to it on the planner's preference for fewer stages and
        micro-batches)."""
        self._chosen_throughput = throughput

    def _of(self, candidate: Candidate) -> list[_Record]:
        """The records ``candidate`` counts in: its schedule's and its layout kind's."""
        kind = _layout_kind(candidate)
        schedule = self._records[candidate.schedule]
        return [schedule] if kind is None else [schedule, self._layouts[kind]]

    def tried(self, candidate: Candidate, peak: float, fits: bool) -> None:
        """``candidate`` ran a layout and needs ``peak`` bytes on its fullest worker."""
        for record in self._of(candidate):
            record.runnable = True
            if fits and (record.fitting is None or peak < record.fitting[0]):
                record.fitting = (peak, candidate)
            elif not fits and (record.over_limit is None or peak < record.over_limit[0]):
                record.over_limit = (peak, candidate)

    def host_over(self, schedule: str, host_bytes: float, limit: float) -> None:
        """``schedule`` keeps the model in a host store of ``host_bytes``, over the host
        memory ``limit``: it was not tried."""
        self._records[schedule].host_over = (host_bytes, limit)

    def bounded(self, candidate: Candidate, ceiling: float) -> None:
        """A fitting ``candidate`` can reach at most ``ceiling`` samples per second."""
        for record in self._of(candidate):
            record.ceiling = max(record.ceiling, ceiling)

    def ruled_out(self, candidate: Candidate, ceiling: float) -> None:
        """A fitting ``candidate`` was not simulated: it can reach at most ``ceiling``
        samples per second (by its written bound, :mod:`pipetrain.planning.bounds`), too
        few to be chosen."""
        for record in self._of(candidate):
            record.ruled_out = max(record.ruled_out, ceiling)

    def simulated(self, candidate: Candidate, throughput: float) -> None:
        """A fitting ``candidate`` was simulated at ``throughput`` samples per second."""
        for record in self._of(candidate):
            record.simulated = max(record.simulated, throughput)

    def rejected_layouts(self, chosen: str | None, memory_limit: float | None) -> dict[str, str]:
        """Each kind of replicated layout (``replicated``: whole copies, ``sharded``) but the
        plan's (``chosen``; ``None`` for one with no replicated stage), with the reason it
        lost; a kind no candidate had is left out."""
        return {
            kind: self._reason(record, memory_limit)
            for kind, record in self._layouts.items()
            if kind != chosen and record.runnable
        }

    def rejected(self, chosen: str, memory_limit: float | None) -> dict[str, str]:
        """Every schedule but ``chosen``, with the reason it lost."""
        return {
            name: self._reason(record, memory_limit)
            for name, record in self._records.items()
            if name != chosen
        }

    def _reason(self, record: _Record, memory_limit: float | None) -> str:
        """Why the configurations of ``record`` lost to the plan chosen."""
        if record.host_over is not None:
            host_bytes, limit = record.host_over
            return (
                f"its host store holds the whole model, {format_bytes(host_bytes)}, over the "
                f"host memory limit of {format_bytes(limit)}"
            )
        if not record.runnable:
            return (
                "runs none of the layouts tried (too few layers for its chunks per "
                "worker, or micro-batch counts it refuses)"
            )
        if record.fitting is None and record.over_limit is not None:
            peak, candidate = record.over_limit
            return (
                f"over the memory limit of {format_bytes(memory_limit or 0.0)}: needs at "
                f"least {format_bytes(peak)} on a worker ({candidate.microbatches} "
                f"micro-batches, recomputation {candidate.recompute})"
            )
        if record.fitting is None:
            return "no configuration of it was tried"
        peak, candidate = record.fitting
        fits = f"fits with recomputation {candidate.recompute} ({format_bytes(peak)} on a worker)"
        if record.over_limit is not None:
            over, cheaper = record.over_limit
            fits = (
                f"over the memory limit of {format_bytes(memory_limit or 0.0)} with "
                f"recomputation {cheaper.recompute} ({format_bytes(over)} on a worker); " + fits
            )
        level = self._chosen_throughput * (1 - 1e-9)  # as fast as the plan chosen
        best = max(record.simulated, record.ruled_out)
        if best >= level:
            reaches = (
                f"reaches {record.simulated:.4g}"
                if record.simulated >= level
                else f"could reach at most {record.ruled_out:.4g}"
            )
            return (
                f"{fits} and {reaches} samples/s steady, but the plan chosen "
                f"({self._chosen_throughput:.4g} steady) is as fast or within a few percent, "
                "with fewer stages or micro-batches (or less memory, or whole copies)"
            )
        if best > 0:
            return f"{fits} but is slower: {best:.4g} samples/s steady at best"
        return (
            f"{fits} but cannot be faster: at most {record.ceiling:.4g} samples/s steady by its "
            "lower bound"
        )
