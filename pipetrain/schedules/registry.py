"""The schedule registry: every fact about a schedule family in one :class:`ScheduleSpec`.

A family is one file that declares its generator and its facts; the runtime, the planner,
its memory model, the command line and the docs ask the spec and never compare names.
User code adds a family with :func:`register`, after which every part of pipetrain accepts
it by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pipetrain.allocation import collector_paused
from pipetrain.checks import positive_int
from pipetrain.schedules.actions import Action
from pipetrain.schedules.errors import ScheduleError
from pipetrain.schedules.lower import full_backwards, lower
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.validate import validate

Options = Mapping[str, int | bool]
"""A schedule's options by name, defaults filled in."""

UniformCosts = tuple[float, float, float]
"""Forward, backward (input gradient) and weight-gradient time of every stage."""

Bubble = tuple[str, float]
"""A textbook bubble: its formula as text and its value."""

MAX_RANK_MICROBATCHES = 1_000_000
"""The most ranks × micro-batches a call plays that :func:`build` accepts: building,
checking and simulating cost time and memory in proportion to it (a million, ``1f1b`` on 8
ranks: 16 s to build, 11 s to simulate, 1.6 GB at peak on a 2-core machine), so larger
requests are refused at once instead of running out of memory."""


class Generated(NamedTuple):
    """What a generator returns: each rank's written actions (compute, ``ALLREDUCE`` and
    ``STEP``, in order), the ranks holding each model stage, and facts for the validator
    (``max_versions``, ``vertical_sync``) to keep in :attr:`Schedule.options`."""

    orders: Sequence[Sequence[Action]]
    stage_ranks: Sequence[tuple[int, ...]]
    facts: Mapping[str, int | bool] = {}


Generator = Callable[[int, int, "Sequence[int] | None", Options], Generated]
"""``generate(ranks, microbatches, replicas, options)``; ``replicas`` is ``None`` unless
the caller asked for replicated stages (then it has one count per stage, summing to
``ranks``)."""


@dataclass(frozen=True)
class Option:
    """A schedule option: an integer (at least ``minimum``) or a flag, with its default."""

    name: str
    default: int | bool
    help: str
    minimum: int = 1

    def checked(self, value: object, schedule: str) -> int | bool:
        """``value`` if it is of this option's type and range, else a ValueError naming it."""
        if isinstance(self.default, bool):
            if not isinstance(value, bool):
                raise ValueError(
                    f"{schedule} option {self.name} must be True or False, got {value!r}"
                )
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < self.minimum:
            raise ValueError(
                f"{schedule} option {self.name} must be an integer >= {self.minimum}, got {value!r}"
            )
        return value


def _every_microbatch(microbatches: int, options: Options) -> int:
    return microbatches


def _one_version(stage: int, replicas: Sequence[int], options: Options) -> int:
    return 1


def _round_robin(stage: int, ranks: int) -> int:
    return stage % ranks


@dataclass(frozen=True)
class ScheduleSpec:
    """Everything pipetrain needs to know about one schedule family.

    - ``generate`` makes the written actions (see :data:`Generator`); ``check(ranks,
      microbatches, replicas, options)`` raises ValueError for sizes the family cannot run.
    - ``options``: typed options; ``chunk_option`` names the one that sets model stages
      per rank (``None``: one stage per rank); ``placement(stage, ranks)`` is the rank
      holding a chunked stage.
    - ``asynchronous``: updates inside the step (so training needs an optimizer) with weight
      versions; ``replicable``: runs stages on several ranks; ``split_backward``: ``W``
      separate from ``B``.
    - ``window(microbatches, options)``: micro-batches the schedule runs in all;
      ``per_update(microbatches, options)``: micro-batches whose gradients make one update.
    - Memory model: ``in_flight(stage, microbatches, replicas, chunks)``, micro-batches a
      rank of ``stage`` holds at once (chunk micro-batches when chunked);
      ``weight_versions(stage, replicas, options)``, weight copies it keeps.
    - ``textbook_bubble(ranks, window, options, (forward, backward, weight))``: the
      formula and value of the bubble fraction at uniform costs without communication
      (``None`` where none holds); ``default_costs``: the CLI's default
      per-micro-batch times; ``planned_by_default``: the planner tries it unless told.
    - ``host_weights``: the weights live in a host store that the ranks ``LOAD`` stages
      from and ``OFFLOAD`` gradients to, and the host steps
      (:mod:`~pipetrain.schedules.residency`); the planner prices such a family on its own
      layouts (:mod:`pipetrain.planning.host_store`); the runtime keeps such stages in a
      host store on each rank (``pipetrain.runtime.rank.host_store``).
    """

    name: str
    summary: str
    generate: Generator
    options: tuple[Option, ...] = ()
    check: Callable[[int, int, Sequence[int] | None, Options], None] | None = None
    chunk_option: str | None = None
    placement: Callable[[int, int], int] = _round_robin
    asynchronous: bool = False
    replicable: bool = False
    split_backward: bool = False
    window: Callable[[int, Options], int] = _every_microbatch
    per_update: Callable[[int, Options], int] = _every_microbatch
    in_flight: Callable[[int, int, Sequence[int], int], int] | None = None
    weight_versions: Callable[[int, Sequence[int], Options], int] = _one_version
    textbook_bubble: Callable[[int, int, Options, UniformCosts], Bubble | None] | None = None
    default_costs: Mapping[str, float] = field(
        default_factory=lambda: {"forward_s": 1.0, "backward_s": 2.0, "weight_s": 0.0}
    )
    planned_by_default: bool = False
    host_weights: bool = False

    def resolve(self, options: Mapping[str, object]) -> dict[str, int | bool]:
        """``options`` checked against this family's, defaults filled in."""
        known = {option.name: option for option in self.options}
        unknown = sorted(set(options) - set(known))
        if unknown:
            accepted = ", ".join(known) or "none"
            raise ValueError(
                f"{self.name} has no option {unknown[0]!r}; its options are: {accepted}"
            )
        return {
            name: option.checked(options.get(name, option.default), self.name)
            for name, option in known.items()
        }

    def chunks(self, options: Mapping[str, object]) -> int:
        """Model stages per rank under ``options``."""
        if self.chunk_option is None:
            return 1
        return int(self.resolve(options)[self.chunk_option])

    def accepts(
        self,
        ranks: int,
        microbatches: int,
        replicas: Sequence[int] | None = None,
        options: Mapping[str, object] | None = None,
    ) -> bool:
        """Whether :func:`build` would accept these sizes (for the planner's candidates)."""
        try:
            _checked_sizes(self, ranks, microbatches, replicas, self.resolve(options or {}))
        except ValueError:
            return False
        return True


_REGISTRY: dict[str, ScheduleSpec] = {}


def register(spec: ScheduleSpec, replace: bool = False) -> ScheduleSpec:
    """Add ``spec`` so that every part of pipetrain accepts its name; return it.

    A name already registered is refused unless ``replace`` is true.
    """
    if not isinstance(spec, ScheduleSpec):
        raise TypeError(f"register takes a ScheduleSpec, got {type(spec).__name__}")
    if not spec.name or any(c.isspace() or c == ":" for c in spec.name):
        raise ValueError(f"a schedule name needs no spaces or colons, got {spec.name!r}")
    if spec.name in _REGISTRY and not replace:
        raise ValueError(f"schedule {spec.name!r} is registered already; pass replace=True")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a registered schedule family (a user's, once done with it)."""
    spec(name)
    del _REGISTRY[name]


def names() -> tuple[str, ...]:
    """Registered schedule names, in registration order."""
    return tuple(_REGISTRY)


def spec(name: str) -> ScheduleSpec:
    """The spec registered as ``name``; ValueError listing the names if there is none."""
    found = _REGISTRY.get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(_REGISTRY)}")
    return found


def _checked_sizes(
    family: ScheduleSpec,
    ranks: int,
    microbatches: int,
    replicas: Sequence[int] | None,
    options: Options,
) -> None:
    positive_int("ranks", ranks)
    positive_int("microbatches", microbatches)
    if replicas is not None:
        if not family.replicable:
            replicable = [s.name for s in _REGISTRY.values() if s.replicable]
            raise ValueError(
                f"replicas are supported by {', '.join(replicable)}, not {family.name!r}"
            )
        for count in replicas:
            positive_int("every replica count", count)
        if sum(replicas) != ranks:
            raise ValueError(
                f"replicas {list(replicas)} place {sum(replicas)} ranks, but ranks={ranks}: "
                "give one count per stage, adding up to the ranks"
            )
    if family.check is not None:
        family.check(ranks, microbatches, replicas, options)
    window = family.window(microbatches, options)
    if ranks * window > MAX_RANK_MICROBATCHES:
        raise ValueError(
            f"{ranks} ranks playing {window} micro-batches a call make {ranks * window:,} "
            f"rank micro-batches, more than the {MAX_RANK_MICROBATCHES:,} a schedule may "
            "hold (its actions are built, checked and simulated one by one); give fewer "
            "ranks or micro-batches"
        )


def build(
    name: str,
    ranks: int,
    microbatches: int,
    *,
    replicas: Sequence[int] | None = None,
    **options: int | bool,
) -> Schedule:
    """Build, lower and validate the schedule ``name`` on ``ranks`` ranks.

    ``microbatches`` is the micro-batch count per optimizer step (for ``pipedream`` the
    mini-batches in the window, for ``2bw`` per update). ``replicas`` gives ranks per
    stage for replicable families (one count per stage, adding up to ``ranks``).
    ``options`` are the family's own (``virtual`` for ``interleaved``, ...).
    """
    family = spec(name)
    resolved = family.resolve(options)
    _checked_sizes(family, ranks, microbatches, replicas, resolved)
    with collector_paused():
        orders, stage_ranks, facts = family.generate(
            ranks, microbatches, None if replicas is None else list(replicas), resolved
        )
        if len(orders) != ranks:
            raise ScheduleError(
                f"the {name} generator wrote actions for {len(orders)} ranks; ranks={ranks}"
            )
        schedule = Schedule(
            name=name,
            stages=len(stage_ranks),
            microbatches=family.window(microbatches, resolved),
            ranks=lower(orders, stage_ranks, full_backwards=full_backwards({**resolved, **facts})),
            stage_ranks=tuple(tuple(r) for r in stage_ranks),
            split_backward=family.split_backward,
            asynchronous=family.asynchronous,
            options={**resolved, **facts},
        )
        validate(schedule)
    return schedule
