"""Per-layer costs of a model: the :class:`Profile` that the planner reads.

A profile is plain data. :func:`pipetrain.profile` measures one; it can also be written by
hand, saved to JSON and loaded back.
"""

from __future__ import annotations

import copy
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from pipetrain.checks import non_negative_number, positive_int
from pipetrain.jsonfile import JsonFile, unversioned, versioned
from pipetrain.profiler.collectives import Collectives

FORMAT_VERSION = 1
"""Version of the JSON layout written by :meth:`Profile.save`."""

_TIME_FIELDS = ("forward_s", "backward_s", "weight_backward_s")
_BATCH_BYTE_FIELDS = ("activation_bytes", "saved_bytes")
_OPTIONAL_FIELDS = ("weight_backward_s", "saved_bytes")
MAX_SECONDS = 1e6
"""The largest time a profile may give one layer's pass, a message or a byte (11.6 days):
no measurement, and sums of larger ones overflow the planner's predictions to infinity."""
MAX_BYTES = 1e18
"""The largest size a profile may give (an exabyte), for the same reason."""


@dataclass
class LayerCost:
    """What one layer costs for one micro-batch at the profile's micro-batch size.

    ``backward_s`` is the full backward (input gradient and weight gradient);
    ``weight_backward_s`` is the weight-gradient share of it where it was measured
    (``None`` otherwise). ``activation_bytes`` is the size of the layer's output,
    ``parameter_bytes`` of its weights, ``optimizer_bytes`` of its optimizer state, and
    ``peak_memory_bytes`` the most memory the layer's forward and backward allocate beyond
    its inputs and weights. ``saved_bytes`` is what the layer's forward keeps until its
    backward besides its inputs and weights: its output and every other tensor autograd
    saves (``None`` where not measured; the memory model then counts the output alone).
    ``optimizer_s`` is one optimizer step over the layer's weights: it happens once per
    update, so it does not scale with the micro-batch size.
    """

    forward_s: float
    backward_s: float
    activation_bytes: float = 0.0
    parameter_bytes: float = 0.0
    weight_backward_s: float | None = None
    optimizer_bytes: float = 0.0
    peak_memory_bytes: float = 0.0
    name: str = ""
    optimizer_s: float = 0.0
    saved_bytes: float | None = None

    @property
    def compute_s(self) -> float:
        """Forward plus full backward time."""
        return self.forward_s + self.backward_s

    @property
    def weight_share_s(self) -> float:
        """The weight-gradient part of the backward; half of it when it was not measured.

        Half follows the zero-bubble papers' usual assumption that the input-gradient and
        weight-gradient passes cost about the same.
        """
        if self.weight_backward_s is None:
            return self.backward_s / 2
        return self.weight_backward_s


@dataclass
class Spread:
    """The measured runs behind a profile's medians, for predicting how much a step varies.

    ``forward_s[r][i]`` and ``backward_s[r][i]`` are layer ``i``'s forward and backward in
    measured run ``r``, on the same scale as the layer's median (``LayerCost.forward_s``,
    ``backward_s``). A stage runs its layers one after another, so its time in run ``r`` is
    the sum over its layers; a slow moment that stretches one layer in a run shows up in
    that run's sum, as it does in the stage's action.
    """

    forward_s: list[list[float]]
    backward_s: list[list[float]]

    def check(self, layers: int) -> None:
        """Raise unless every run has ``layers`` finite non-negative times, and runs exist."""
        for name in ("forward_s", "backward_s"):
            runs = getattr(self, name)
            if not isinstance(runs, list) or not runs:
                raise ValueError(f"Spread.{name} must be a non-empty list of runs, got {runs!r}")
            for index, run in enumerate(runs):
                if not isinstance(run, list) or len(run) != layers:
                    raise ValueError(
                        f"Spread.{name} run {index} must list {layers} layer times (one per layer)"
                    )
                for value in run:
                    non_negative_number(f"Spread run {index}: {name}", value)

    def stage_factors(
        self, start: int, stop: int, medians: tuple[float, float]
    ) -> tuple[list[float], list[float]]:
        """Per run, layers ``start..stop-1``'s forward and backward time over their medians' sums
        ``medians``: how much slower or faster than the median prediction that stage ran."""
        forward_median, backward_median = medians
        return (
            [
                sum(run[start:stop]) / forward_median if forward_median > 0 else 1.0
                for run in self.forward_s
            ],
            [
                sum(run[start:stop]) / backward_median if backward_median > 0 else 1.0
                for run in self.backward_s
            ],
        )

    def scaled(self, factor: float) -> Spread:
        """The same runs with every time multiplied by ``factor``."""
        return Spread(
            [[t * factor for t in run] for run in self.forward_s],
            [[t * factor for t in run] for run in self.backward_s],
        )


@dataclass
class Profile(JsonFile):
    """Per-layer costs of a model, in execution order.

    ``microbatch_size`` is the micro-batch size the costs were measured at and
    ``input_bytes`` the size of one such micro-batch of model input. ``message_s`` is the
    time a message between two workers keeps each side busy (packing, copying), whatever
    it carries, and ``send_byte_s`` and ``receive_byte_s`` what each byte it carries adds
    on the sending and the receiving side, where they were measured: the planner charges
    them to every send and receive (``Costs.send_s``, ``Costs.receive_s`` and their
    ``_byte_s``). ``weight_version_byte_s`` is what an asynchronous schedule's update
    spends on each byte of its stage's weights besides the optimizer's step (the next
    weight version's copy, the gradients' norm): the planner adds it to those schedules'
    optimizer steps. ``shared_cores_factor`` is how many times longer the model's work
    takes where the workers outnumber the cores they share than with a core to itself
    (caches refilled and threads switched: 1.07-1.18 in an emulated cluster's plan jobs, four
    workers on two cores); the planner multiplies the stages' compute by it where it models
    shared cores.
    ``spread`` (optional) holds the measured runs behind the medians; with it the planner
    predicts the median step of a pipeline whose actions vary from run to run as measured,
    rather than the step of one whose every action takes exactly its median.
    ``other_sizes`` (optional) holds the same model measured at other micro-batch sizes,
    from which :meth:`scaled` starts when nearer: a sample costs more in a small
    micro-batch than in a large one (the VGG model's: 1.19 ms at 8, 1.03 at 16, 0.84 at 32).
    ``model`` names the model measured (a built-in model's name; ``""`` where unnamed), and
    plans made from the profile carry it, so that one is refused for another model.
    ``collectives`` (optional) is what the workers' all-reduce, all-gather and
    reduce-scatter cost a byte where they were measured (``train --plan auto``); the
    planner charges a replicated or sharded stage's collectives no less.
    """

    layers: list[LayerCost]
    microbatch_size: int = 1
    input_bytes: float = 0.0
    message_s: float = 0.0
    spread: Spread | None = None
    other_sizes: tuple[Profile, ...] = ()
    send_byte_s: float = 0.0
    receive_byte_s: float = 0.0
    weight_version_byte_s: float = 0.0
    shared_cores_factor: float = 1.0
    model: str = ""
    collectives: Collectives | None = None

    def __post_init__(self) -> None:
        """Reject empty profiles and negative or non-finite costs, naming the layer and field."""
        if not isinstance(self.model, str):
            raise TypeError(f"Profile.model must be a str, got {type(self.model).__name__}")
        if not isinstance(self.layers, list) or not self.layers:
            raise ValueError("a Profile needs a non-empty list of LayerCost, one per layer")
        for index, layer in enumerate(self.layers):
            _check_layer(index, layer)
        positive_int("microbatch_size", self.microbatch_size)
        non_negative_number("Profile.input_bytes", self.input_bytes)
        _at_most("Profile.input_bytes", self.input_bytes, seconds=False)
        for name in ("message_s", "send_byte_s", "receive_byte_s", "weight_version_byte_s"):
            non_negative_number(f"Profile.{name}", getattr(self, name))
            _at_most(f"Profile.{name}", getattr(self, name), seconds=True)
        non_negative_number("Profile.shared_cores_factor", self.shared_cores_factor)
        if self.shared_cores_factor < 1:
            raise ValueError(
                f"Profile.shared_cores_factor = {self.shared_cores_factor} is below 1: sharing "
                "cores cannot make work faster; use 1 for no slowdown"
            )
        if self.collectives is not None and not isinstance(self.collectives, Collectives):
            raise TypeError(
                "Profile.collectives must be a Collectives or None, got "
                f"{type(self.collectives).__name__}"
            )
        if self.spread is not None:
            if not isinstance(self.spread, Spread):
                raise TypeError(
                    f"Profile.spread must be a Spread or None, got {type(self.spread).__name__}"
                )
            self.spread.check(len(self.layers))
        sizes = [self.microbatch_size]
        for other in self.other_sizes:
            if not isinstance(other, Profile) or other.other_sizes:
                raise TypeError("Profile.other_sizes must hold Profiles without other_sizes")
            if len(other.layers) != len(self.layers) or other.microbatch_size in sizes:
                raise ValueError(
                    f"Profile.other_sizes: a profile of {len(other.layers)} layers at "
                    f"micro-batch size {other.microbatch_size} beside {len(self.layers)} layers "
                    f"at sizes {sizes}; give each size once, of the same model"
                )
            sizes.append(other.microbatch_size)

    def __len__(self) -> int:
        """The number of layers."""
        return len(self.layers)

    def scaled(self, microbatch_size: int) -> Profile:
        """This profile at another micro-batch size: times and activations scale linearly
        from the measured size nearest it (this one's or one of ``other_sizes``), which the
        result keeps for further scaling.

        Weights and optimizer state do not change. The peak memory keeps its
        ``parameter_bytes`` part (weight gradients) and scales the rest.
        """
        positive_int("microbatch_size", microbatch_size)
        alone = copy.copy(self)  # this profile without its other sizes: checked already
        alone.other_sizes = ()
        measured = [alone, *self.other_sizes]
        start = min(measured, key=lambda p: abs(math.log(microbatch_size / p.microbatch_size)))
        factor = microbatch_size / start.microbatch_size
        return replace(
            self,
            layers=[_scaled_layer(layer, factor) for layer in start.layers],
            microbatch_size=microbatch_size,
            input_bytes=start.input_bytes * factor,
            spread=None if start.spread is None else start.spread.scaled(factor),
            other_sizes=tuple(p for p in measured if p.microbatch_size != microbatch_size),
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary with a ``format_version``."""
        return versioned(
            FORMAT_VERSION,
            {
                "microbatch_size": self.microbatch_size,
                "input_bytes": self.input_bytes,
                "message_s": self.message_s,
                "send_byte_s": self.send_byte_s,
                "receive_byte_s": self.receive_byte_s,
                "weight_version_byte_s": self.weight_version_byte_s,
                "shared_cores_factor": self.shared_cores_factor,
                "model": self.model,
                "layers": [asdict(layer) for layer in self.layers],
                "spread": None if self.spread is None else asdict(self.spread),
                "other_sizes": [other.to_dict() for other in self.other_sizes],
                "collectives": None if self.collectives is None else self.collectives.to_dict(),
            },
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        """Rebuild a profile from :meth:`to_dict` output; raise ValueError on another format."""
        data = unversioned(
            data, "profile", FORMAT_VERSION, "Measure the profile again with pipetrain.profile()."
        )
        known = {f.name for f in fields(LayerCost)}
        layers = []
        for index, entry in enumerate(data.get("layers", [])):
            unknown = set(entry) - known
            if unknown:
                raise ValueError(f"profile layer {index} has unknown fields {sorted(unknown)}")
            try:
                layers.append(LayerCost(**entry))
            except TypeError as error:
                raise ValueError(f"profile layer {index} is incomplete: {error}") from None
        spread = data.get("spread")
        if spread is not None:
            if not isinstance(spread, dict) or set(spread) != {"forward_s", "backward_s"}:
                raise ValueError(
                    "profile spread must be an object with forward_s and backward_s (lists of runs)"
                )
            spread = Spread(**spread)
        return cls(
            layers,
            data.get("microbatch_size", 1),
            data.get("input_bytes", 0.0),
            data.get("message_s", 0.0),
            spread,
            tuple(cls.from_dict(other) for other in data.get("other_sizes", [])),
            data.get("send_byte_s", 0.0),
            data.get("receive_byte_s", 0.0),
            data.get("weight_version_byte_s", 0.0),
            data.get("shared_cores_factor", 1.0),
            data.get("model", ""),
            None if data.get("collectives") is None else Collectives.from_dict(data["collectives"]),
        )


def pooled(profiles: Sequence[Profile]) -> Profile:
    """One profile from several of the same model, measured on different workers at once.

    Each layer's times are the mean of the workers' medians; the spread, where every
    profile has one, holds every worker's runs, so the planner sees how all of them varied.
    Sizes, the micro-batch size, the message costs, ``weight_version_byte_s`` and
    ``shared_cores_factor`` come from the first profile; each of
    ``other_sizes`` is pooled the same way.
    """
    if not profiles:
        raise ValueError("pooled needs at least one profile")
    first = profiles[0]
    for index, other in enumerate(profiles[1:], 1):
        if len(other.layers) != len(first.layers) or other.microbatch_size != first.microbatch_size:
            raise ValueError(
                f"profile {index} has {len(other.layers)} layers at micro-batch size "
                f"{other.microbatch_size}, profile 0 has {len(first.layers)} at "
                f"{first.microbatch_size}; pool profiles of the same model and size"
            )
        if len(other.other_sizes) != len(first.other_sizes):
            raise ValueError(
                f"profile {index} was measured at {len(other.other_sizes)} other sizes, "
                f"profile 0 at {len(first.other_sizes)}; pool profiles of the same sizes"
            )
    layers = []
    for index, layer in enumerate(first.layers):
        column = [profile.layers[index] for profile in profiles]
        forward_s, backward_s, optimizer_s = (
            statistics.mean(getattr(c, name) for c in column)
            for name in ("forward_s", "backward_s", "optimizer_s")
        )
        shares = [c.weight_backward_s for c in column if c.weight_backward_s is not None]
        weight_backward_s = (
            min(statistics.mean(shares), backward_s) if len(shares) == len(column) else None
        )
        layers.append(
            replace(
                layer,
                forward_s=forward_s,
                backward_s=backward_s,
                optimizer_s=optimizer_s,
                weight_backward_s=weight_backward_s,
            )
        )
    spreads = [profile.spread for profile in profiles if profile.spread is not None]
    spread = (
        Spread(
            [run for s in spreads for run in s.forward_s],
            [run for s in spreads for run in s.backward_s],
        )
        if len(spreads) == len(profiles)
        else None
    )
    others = tuple(
        pooled([profile.other_sizes[index] for profile in profiles])
        for index in range(len(first.other_sizes))
    )
    return replace(first, layers=layers, spread=spread, other_sizes=others)


_CHECKED_FIELDS = tuple(
    (field.name, field.name in (*_TIME_FIELDS, "optimizer_s"))
    for field in fields(LayerCost)
    if field.name != "name"
)
"""Each checked field of a layer, and whether it is a time (else bytes)."""


def _layer_name(index: int, layer: LayerCost) -> str:
    """How errors name a layer: its index, and its name where it has one."""
    return f"layer {index}" + (f" ({layer.name})" if layer.name else "")


def _check_layer(index: int, layer: object) -> None:
    """Raise if a layer entry is not a LayerCost or holds a negative or non-finite value."""
    if not isinstance(layer, LayerCost):
        raise TypeError(
            f"layer {index} is a {type(layer).__name__}; Profile.layers must hold LayerCost values"
        )
    for name, seconds in _CHECKED_FIELDS:
        value = getattr(layer, name)
        if (name in _OPTIONAL_FIELDS and value is None) or (
            type(value) is float and 0 <= value <= (MAX_SECONDS if seconds else MAX_BYTES)
        ):
            continue  # the common case, without the messages' strings (profiles are rechecked)
        where = _layer_name(index, layer)
        non_negative_number(f"{where}: {name}", value)
        _at_most(f"{where}: {name}", value, seconds)
    if layer.weight_backward_s is not None and layer.weight_backward_s > layer.backward_s:
        where = _layer_name(index, layer)
        raise ValueError(
            f"{where}: weight_backward_s = {layer.weight_backward_s} exceeds backward_s = "
            f"{layer.backward_s}; backward_s is the full backward, so its weight share "
            "cannot be larger"
        )


def _at_most(name: str, value: float, seconds: bool) -> None:
    """Raise if ``value`` (seconds, or else bytes) is beyond :data:`MAX_SECONDS` or
    :data:`MAX_BYTES`."""
    limit = MAX_SECONDS if seconds else MAX_BYTES
    if value > limit:
        raise ValueError(
            f"{name} = {value:g} exceeds {limit:g} {'seconds' if seconds else 'bytes'}: no "
            "measurement is that large; give the measured value"
        )


def _scaled_layer(layer: LayerCost, factor: float) -> LayerCost:
    """One layer's costs with batch-proportional fields multiplied by ``factor``."""
    changes: dict[str, Any] = {}
    for name in _TIME_FIELDS + _BATCH_BYTE_FIELDS:
        value = getattr(layer, name)
        changes[name] = None if value is None else value * factor
    batch_part = max(layer.peak_memory_bytes - layer.parameter_bytes, 0.0)
    fixed_part = layer.peak_memory_bytes - batch_part
    changes["peak_memory_bytes"] = fixed_part + batch_part * factor
    return replace(layer, **changes)
