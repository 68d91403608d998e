"""Give a stage module built on the meta device real tensors on its device, initialized.

A model created under ``with torch.device("meta"):`` holds shapes and dtypes but no
memory, so every rank can build the whole model for nothing and :func:`materialize` only
its own stage: its meta tensors are allocated on the device (tied names keep one tensor),
then set from ``weights``, by ``init_fn``, or by their modules' own reset methods. A
tensor none of these sets is an error, never uninitialized memory left behind: floating
tensors are allocated filled with NaN and must hold none afterwards, others must have
been written (their version counter moved) or replaced.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor, nn

from pipetrain.model.weights_source import WeightsArg, WeightSource, open_weights

InitFn = Callable[[nn.Module], None]
"""Initializes a materialized module's tensors in place."""

RESET_METHODS = ("reset_parameters", "_reset_parameters", "reset_running_stats")
"""The methods by which a module sets its own parameters and buffers, called in this order."""

_SHOWN = 6  # owners named in an error before "and N more"

M = TypeVar("M", bound=nn.Module)


@dataclass(frozen=True)
class _Slot:
    """One name of a parameter or buffer: the module holding it and its attribute there."""

    name: str
    path: str
    owner: nn.Module
    attr: str
    buffer: bool

    @property
    def tensor(self) -> Tensor:
        return getattr(self.owner, self.attr)

    @property
    def persistent(self) -> bool:
        """Whether the name is in the module's state dict (a non-persistent buffer is not)."""
        return not self.buffer or self.attr not in self.owner._non_persistent_buffers_set


def materialize(
    module: M,
    device: torch.device | str,
    *,
    init_fn: InitFn | None = None,
    weights: WeightsArg | None = None,
) -> M:
    """Allocate ``module``'s meta tensors on ``device``, initialize them, and move the rest
    there; return ``module`` (changed in place).

    ``module`` is any module whose parameter and buffer names are the full model's (a stage
    module's are). Each tensor is set, in this order of precedence:

    - from ``weights``: a state dict keyed by full-model names, or the path of a
      ``.safetensors`` file or of a ``torch.save``d state dict (``.pt``, ``.pth``,
      ``.bin``), of which only the module's entries are read. Every name of the module's
      state dict must be there (of tied names, one); a non-persistent buffer is taken when
      present. Values are copied in whether or not the module was on the meta device.
    - by ``init_fn(module)``, called before the weights are copied, which must set in place
      every meta tensor the weights do not hold (checked: see below).
    - otherwise by the reset methods (:data:`RESET_METHODS`) of each module holding a meta
      tensor that the weights do not hold.

    Names that share one tensor (tied weights) still share one after. Reset methods draw
    from this process's random generator, so replicas of a stage start equal only on ranks
    seeded alike; load ``weights`` to start exactly as a given model.

    Every tensor that was on the meta device is checked afterwards, whichever of these
    set it: a floating tensor still holding any of the NaN it was allocated with, or
    another never written, is refused.

    Raises:
        ValueError: a meta tensor nothing sets, or sets only in part (naming it, its
            module and that module's type), entries missing from ``weights`` or of
            another shape (naming them and the file), or tied names that ``init_fn``
            separated.
    """
    device = torch.device(device)
    slots = _slots(module)
    ties = _ties(slots)
    fresh = _allocate(slots, device)
    module.to(device)
    if weights is None:
        _initialize(module, slots, fresh, init_fn)
    else:
        with open_weights(weights) as source:
            # a tied tensor is held when any of its names is
            held = {
                s.name for group in ties if any(s.name in source.keys for s in group) for s in group
            }
            _initialize(module, slots, {n: v for n, v in fresh.items() if n not in held}, init_fn)
            _load(slots, ties, source)
    _check_ties(ties)
    unset = [slot for slot in slots if slot.name in fresh and _unset(slot, *fresh[slot.name])]
    if unset:
        raise ValueError(_unset_message(unset, init_fn is not None))
    module.to(device)  # a tensor an initializer assigned anew may sit elsewhere
    return module


def _slots(module: nn.Module) -> list[_Slot]:
    """Every name of every parameter and buffer, with its holder (shared modules included)."""
    slots = []
    for path, owner in module.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        for attr, parameter in owner._parameters.items():
            if parameter is not None:
                slots.append(_Slot(prefix + attr, path, owner, attr, buffer=False))
        for attr, buffer in owner._buffers.items():
            if buffer is not None:
                slots.append(_Slot(prefix + attr, path, owner, attr, buffer=True))
    return slots


def _ties(slots: list[_Slot]) -> list[list[_Slot]]:
    """The slots grouped by the tensor they hold, in order of first appearance."""
    groups: dict[int, list[_Slot]] = {}
    for slot in slots:
        groups.setdefault(id(slot.tensor), []).append(slot)
    return list(groups.values())


def _allocate(slots: list[_Slot], device: torch.device) -> dict[str, tuple[Tensor, int]]:
    """Replace every meta tensor with an uninitialized one on ``device``, one per tensor
    however many names it has (``Module.to_empty`` would untie them), and return the
    names replaced, each with its new tensor and that tensor's version counter."""
    made: dict[int, Tensor] = {}
    originals = [slot.tensor for slot in slots]  # alive while ids are compared
    for slot, tensor in zip(slots, originals):
        if not tensor.is_meta:
            continue
        if id(tensor) not in made:
            # NaN marks what no initializer wrote (checked by _unset)
            fill = float("nan") if tensor.is_floating_point() or tensor.is_complex() else None
            empty = (
                torch.empty_like(tensor, device=device)
                if fill is None
                else torch.full_like(tensor, fill, device=device)
            )
            made[id(tensor)] = (
                nn.Parameter(empty, requires_grad=tensor.requires_grad)
                if isinstance(tensor, nn.Parameter)
                else empty
            )
        setattr(slot.owner, slot.attr, made[id(tensor)])
    return {
        slot.name: (slot.tensor, slot.tensor._version)
        for slot, tensor in zip(slots, originals)
        if id(tensor) in made
    }


def _initialize(
    module: nn.Module,
    slots: list[_Slot],
    pending: dict[str, tuple[Tensor, int]],
    init_fn: InitFn | None,
) -> None:
    """Set the ``pending`` tensors: by ``init_fn``, or by their holders' reset methods
    (what they leave unset is found by :func:`_unset` afterwards)."""
    if init_fn is not None:
        init_fn(module)
        return
    waiting = [slot for slot in slots if slot.name in pending]
    holders = {id(slot.owner): slot.owner for slot in waiting}
    with torch.no_grad():
        for owner in holders.values():
            for method in RESET_METHODS:
                reset = getattr(owner, method, None)
                if callable(reset):
                    reset()


def _unset(slot: _Slot, allocated: Tensor, version: int) -> bool:
    """Whether ``slot`` still holds memory no initializer wrote: NaN left in a floating
    tensor (a write through ``.data`` moves no version counter, so values decide), or
    another tensor as allocated, its version unmoved."""
    tensor = slot.tensor
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(torch.isnan(tensor).any())
    return tensor is allocated and tensor._version == version


def _unset_message(unset: list[_Slot], by_init_fn: bool) -> str:
    """Name each tensor nothing set, grouped by the module holding it."""
    by_owner: dict[str, list[_Slot]] = {}
    for slot in unset:
        by_owner.setdefault(slot.path, []).append(slot)
    parts = []
    for path, held in list(by_owner.items())[:_SHOWN]:
        owner = held[0].owner
        methods = [m for m in RESET_METHODS if callable(getattr(owner, m, None))]
        if by_init_fn:
            why = "which init_fn left unset, in whole or in part"
        elif methods:
            why = f"whose {'/'.join(f'{m}()' for m in methods)} left them unset"
        else:
            why = "which has none of " + ", ".join(f"{m}()" for m in RESET_METHODS)
        names = ", ".join(
            f"{'buffer' if s.buffer else 'parameter'} {s.name!r}"
            + ("" if s.persistent else " (non-persistent, so in no saved state dict)")
            for s in held
        )
        where = f"module {path!r}" if path else "the module itself"
        parts.append(f"{names} of {where} ({type(owner).__name__}, {why})")
    if len(by_owner) > _SHOWN:
        parts.append(f"and those of {len(by_owner) - _SHOWN} more modules")
    return (
        f"{len(unset)} tensors built on the meta device would be left uninitialized: "
        + "; ".join(parts)
        + ". Pass init_fn= (a function of the module that sets them in place), weights= "
        "holding them, or give their module a reset_parameters() that sets them in place"
    )


def _load(slots: list[_Slot], ties: list[list[_Slot]], source: WeightSource) -> None:
    """Copy each tensor's entry from ``source`` (the first of its tied names found)."""
    missing = [
        group[0].name
        for group in ties
        if any(s.persistent for s in group) and not any(s.name in source.keys for s in group)
    ]
    if missing:
        shown = ", ".join(repr(name) for name in missing[:10])
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise ValueError(
            f"{source.label} lacks {len(missing)} of the module's entries: {shown}{more}; "
            "save the whole model's state_dict() (keyed by its full-model names) there"
        )
    with torch.no_grad():
        for group in ties:
            found = next((s for s in group if s.name in source.keys), None)
            if found is None:
                continue
            value, target = source.read(found.name), found.tensor
            if value.shape != target.shape:
                raise ValueError(
                    f"{source.label} holds {found.name!r} of shape {list(value.shape)}, but the "
                    f"module's is {list(target.shape)}; save the weights of this model"
                )
            target.copy_(value)


def _check_ties(ties: list[list[_Slot]]) -> None:
    """Names that shared one tensor before must share one after (an init_fn that assigned
    a new tensor to one of them would split them)."""
    for group in ties:
        if len({id(slot.tensor) for slot in group}) > 1:
            names = ", ".join(repr(s.name) for s in group)
            raise ValueError(
                f"the tied names {names} no longer share one tensor after initialization; "
                "initialize tied weights in place (e.g. with torch.nn.init) instead of "
                "assigning new tensors"
            )
