"""Simulator inputs: :class:`Costs` (times per micro-batch and a communication model) and
:class:`Variation` (how much measured actions vary from run to run)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

PerStage = float | Sequence[float]


@dataclass(frozen=True)
class Costs:
    """Times in seconds per micro-batch and a communication model.

    ``forward_s``, ``backward_s`` (the input-gradient part), ``weight_s`` (the
    weight-gradient part; an unsplit backward costs ``backward_s + weight_s``), ``step_s``
    (optimizer step) and ``allreduce_s`` (a replicated stage's gradient all-reduce) are a
    float for every stage or one value per stage. ``activation_bytes`` and ``bandwidth``
    (bytes/s) are a float or one value per stage boundary (boundary s joins stage s and
    s + 1); a transfer costs ``latency_s + bytes / bandwidth``, and gradients are as large
    as the activations they belong to; the step's targets and gathered outputs cost
    ``latency_s``. ``loss_s`` is the all-reduce of the loss that ends a training step (one
    small message over every rank). ``send_s`` is the time a send keeps the sending rank
    busy (packing the message and handing it to the transport) before it travels, and
    ``receive_s`` the time a receive keeps the receiving rank busy once the data is there
    (copying it in), as on CPU backends; both are per message, whatever it carries.
    ``send_byte_s`` and ``receive_byte_s`` add that much to each for every byte an
    activation or gradient message carries (on shared cores, moving the bytes takes the
    kernel's and the transport's time on both sides).
    ``overlap`` is the share of the shorter pass of an overlapped forward-and-backward pair
    (``OVERLAP``) that the longer one hides: 0 runs them back to back, 1 hides it entirely.
    Micro-batches of different sizes (sequences of different lengths) cost differently:
    ``compute_scale[m]`` multiplies micro-batch ``m``'s forward, backward and weight times
    (a float, or one value per stage) and ``bytes_scale[m]`` its activation and gradient
    bytes; empty, every micro-batch costs the same. ``gather_s`` is a sharded stage's
    all-gather of its parameters (``GATHER``) before the step's passes. ``load_s`` is a
    stage's weights crossing a rank's link from the host store (``LOAD``: its weight bytes
    over the host link), ``offload_s`` its weight gradients crossing back (``OFFLOAD``
    after the stage's backwards on that rank; one after forwards only frees the weights
    and costs nothing).
    """

    forward_s: PerStage
    backward_s: PerStage
    weight_s: PerStage = 0.0
    activation_bytes: PerStage = 0.0
    bandwidth: PerStage = math.inf
    latency_s: float = 0.0
    step_s: PerStage = 0.0
    allreduce_s: PerStage = 0.0
    send_s: float = 0.0
    receive_s: float = 0.0
    send_byte_s: float = 0.0
    receive_byte_s: float = 0.0
    loss_s: float = 0.0
    overlap: float = 0.0
    compute_scale: Sequence[PerStage] = ()
    bytes_scale: Sequence[float] = ()
    gather_s: PerStage = 0.0
    load_s: PerStage = 0.0
    offload_s: PerStage = 0.0

    def per_stage(self, field: str, count: int) -> list[float]:
        """The named field expanded to ``count`` values, checked for length and sign."""
        value = getattr(self, field)
        values = (
            [float(value)] * count if isinstance(value, (int, float)) else [float(v) for v in value]
        )
        if len(values) != count:
            raise ValueError(
                f"Costs.{field} has {len(values)} values, expected {count} (or one float)"
            )
        if any(v < 0 or math.isnan(v) for v in values):
            raise ValueError(f"Costs.{field} must be non-negative, got {values}")
        return values

    def microbatch_scales(
        self, stages: int, microbatches: int
    ) -> tuple[list[list[float]], list[float]]:
        """``compute_scale`` as ``[micro-batch][stage]`` and ``bytes_scale`` per micro-batch,
        each at least ``microbatches`` long (all ones where they are empty); ValueError
        names a missing or negative one."""
        compute = [
            [float(v)] * stages if isinstance(v, (int, float)) else [float(x) for x in v]
            for v in self.compute_scale
        ] or [[1.0] * stages] * microbatches
        sizes = [float(v) for v in self.bytes_scale] or [1.0] * microbatches
        for name, given in (("compute_scale", compute), ("bytes_scale", sizes)):
            if len(given) < microbatches:
                raise ValueError(
                    f"Costs.{name} has {len(given)} micro-batches, the schedule plays "
                    f"{microbatches}"
                )
        if any(len(row) != stages or min(row) < 0 for row in compute) or min(sizes) < 0:
            raise ValueError(
                f"Costs.compute_scale needs non-negative factors for each of {stages} stages "
                "and Costs.bytes_scale non-negative factors"
            )
        return compute, sizes

    def send_busy_s(self, message_bytes: float) -> float:
        """How long a send of ``message_bytes`` keeps the sending rank busy."""
        return self.send_s + message_bytes * self.send_byte_s

    def receive_busy_s(self, message_bytes: float) -> float:
        """How long a receive of ``message_bytes`` keeps the receiving rank busy once its
        message has landed."""
        return self.receive_s + message_bytes * self.receive_byte_s


@dataclass(frozen=True)
class Variation:
    """How much a stage's actions vary from run to run, as measured.

    ``forward[s]`` and ``backward[s]`` are factors by which stage ``s``'s forward and
    backward (with its weight-gradient part) took longer, in measured runs, than their
    cost in :class:`Costs`. Each compute action draws one factor of its kind at random.
    """

    forward: Sequence[Sequence[float]]
    backward: Sequence[Sequence[float]]

    def check(self, stages: int) -> None:
        """Raise unless both kinds have a non-empty list of non-negative factors per stage."""
        for name in ("forward", "backward"):
            factors = getattr(self, name)
            if len(factors) != stages or any(not values or min(values) < 0 for values in factors):
                raise ValueError(
                    f"Variation.{name} needs a non-empty list of non-negative factors for each "
                    f"of the {stages} stages"
                )
