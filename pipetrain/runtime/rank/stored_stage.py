"""Stages whose weights live in the host store, loaded onto the worker for their passes.

Between a stage's ``OFFLOAD`` and its next ``LOAD`` its module's parameters *are* views of
the store (``param.data`` is the store's master weights, in the parameter's dtype: float32
under pipetrain's mixed precision, which autocasts; ``param.grad`` the store's gradient),
so everything that reads or writes them between passes (the update cycle's optimizer
step, clipping, the norm, loss scaling and pair-loss normalization, a checkpoint's save and
load, ``state_dict``) works on the store in place, unchanged, and the optimizer's
parameters are the store's tensors. ``LOAD`` copies the master into a private tensor of the
worker's and points the parameter at it; ``OFFLOAD`` adds the gradients the stage's
backwards made into the store's gradient, points the parameter back at the store and
frees the private tensor's storage (``untyped_storage().resize_(0)``, as FSDP does): the
autograd graph of forwards whose backwards come later keeps that storage object, which
the next ``LOAD`` fills again. The C allocator's free pages go back to the system after
an ``OFFLOAD`` or a part of a step that freed 16 MiB or more (:meth:`StoredStage.return_freed`).
Buffers stay in the module (they are small). A parameter two stages of the rank share (tied
embeddings) is stored once, with the first stage, and stays loaded while either stage is.

The optimizer steps a stage a part at a time (:meth:`StoredStage.parts`: parameters that
lie together, of at most 8 MiB or the largest one's bytes), each part's pages released
before the next, so a step holds one part of the stage's weights, gradients and state. The state is
made by the first step in private memory and moved into the store a part at a time, where
later steps update it in place. After each use a stage's regions are released, so a
worker's resident memory holds the stages it has loaded, not its share of the model.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn

from pipetrain.distributed.heap import FREE_KEPT_BYTES, return_freed_memory
from pipetrain.runtime.rank.host_store import Region, aligned
from pipetrain.schedules import Action

PART_BYTES = 8 * 2**20
"""The most parameter bytes an optimizer step takes at once, beyond the largest parameter:
a step call has a fixed cost (about 0.4 ms of Adam's on CPU), so small parameters go
together."""


class _Slot:
    """One parameter in the store: at ``offset`` of each region of its ``home`` stage."""

    def __init__(self, parameter: torch.Tensor, home: StoredStage, offset: int) -> None:
        self.parameter, self.home, self.offset = parameter, home, offset
        self.private: torch.Tensor | None = None  # the working copy, between LOAD and OFFLOAD
        self.held: torch.Tensor | None = None  # the gradient the store held at the LOAD
        self.lent: weakref.ref[torch.Tensor] | None = None  # the store's gradient, given out
        self.loads = 0  # stages resident that use it

    def master(self) -> torch.Tensor:
        return self.home.master.view(self.offset, self.parameter)

    def load(self, device: torch.device) -> None:
        self.loads += 1
        if self.loads > 1:
            return  # loaded already for another stage
        master, parameter = self.master(), self.parameter
        if self.private is None:
            self.private = torch.empty_like(master, device=device)
        else:  # the storage a pending backward's graph may hold: filled again
            self.private.untyped_storage().resize_(master.numel() * master.element_size())
        self.private.copy_(master)
        self.home.master.release(self.offset, _nbytes(master))  # one parameter's pages at a time
        self.held, parameter.grad = parameter.grad, None
        parameter.data = self.private

    def offload(self) -> None:
        self.loads -= 1
        if self.loads > 0:
            return  # another resident stage still uses it
        parameter = self.parameter
        grad, parameter.grad = self._gradient(parameter.grad), None
        parameter.data = self.master()
        parameter.grad = grad
        assert self.private is not None  # allocated by the LOAD before
        self.private.untyped_storage().resize_(0)

    def _gradient(self, made: torch.Tensor | None) -> torch.Tensor | None:
        """The gradient after an offload: what the store held at the load plus ``made``,
        in the store where the store's tensor is free."""
        held, self.held = self.held, None
        if made is None:
            return held
        grads = self.home.region("grads")
        if held is not None:
            held.add_(made.to(held.device))
        elif self.lent is not None and self.lent() is not None:
            # the store's gradient was taken off the parameter but is still in use (put
            # aside by the pair-loss normalization): this one stays in private memory
            return made
        else:
            held = grads.view(self.offset, self.parameter)
            held.copy_(made)
            self.lent = weakref.ref(held)
        grads.release(self.offset, _nbytes(made))  # one parameter's pages at a time
        return held

    def adopt_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Move the parameter's optimizer state (each tensor laid out as the parameter)
        into the store."""
        parameter = self.parameter
        if parameter not in optimizer.state:
            return
        state = optimizer.state[parameter]
        for key, value in list(state.items()):
            if _like(value, parameter):
                stored = self.home.region(f"state:{key}").view(self.offset, parameter)
                if value.data_ptr() != stored.data_ptr():
                    stored.copy_(value)
                    state[key] = stored


class StoredStage:
    """One stage's parameters in the host store: a region for the master weights, one for
    their gradients and one per kind of optimizer state, laid out alike."""

    def __init__(
        self,
        index: int,
        module: nn.Module,
        device: torch.device,
        stored: dict[int, _Slot] | None = None,
    ) -> None:
        """Copy ``module``'s parameters into the store and point them at it; ``LOAD``
        allocates their working copies on ``device``. Parameters in ``stored`` (by id; a
        slot of another stage's) are shared with that stage; the others' slots are added."""
        self.index, self.device = index, device
        stored = {} if stored is None else stored
        unique = list({id(p): p for p in module.parameters()}.values())
        own, total = [], 0
        for parameter in unique:
            if id(parameter) not in stored:
                stored[id(parameter)] = _Slot(parameter, self, total)
                own.append(stored[id(parameter)])
                total += aligned(parameter.numel() * parameter.element_size())
        self._slots = [stored[id(p)] for p in unique]
        self._own, self._nbytes = own, total
        self._parts: list[set[int]] | None = None
        self.master = Region(f"stage{index}-weights", total)
        self._regions: dict[str, Region] = {}
        with torch.no_grad():
            for slot in own:
                slot.master().copy_(slot.parameter)
                slot.parameter.data = slot.master()
        self.master.release()

    @property
    def resident(self) -> bool:
        """Whether the stage is loaded (its parameters are working copies)."""
        return any(slot.loads for slot in self._slots)

    def region(self, kind: str) -> Region:
        """The stage's region of gradients (``"grads"``) or of one kind of optimizer state,
        made on first use."""
        if kind not in self._regions:
            name = f"stage{self.index}-{len(self._regions)}"
            self._regions[kind] = Region(name, self._nbytes)
        return self._regions[kind]

    def regions(self) -> list[Region]:
        """Every region of the stage."""
        return [self.master, *self._regions.values()]

    def load(self) -> None:
        """``LOAD``: the master weights copied into working tensors the parameters hold;
        gradients already in the store are set aside for :meth:`offload` to add to."""
        with torch.no_grad():
            for slot in self._slots:
                slot.load(self.device)  # each drops its pages of the store once copied

    def offload(self) -> None:
        """``OFFLOAD``: the gradients made since :meth:`load` added into the store's, the
        parameters pointed back at the store and the working tensors freed."""
        with torch.no_grad():
            for slot in self._slots:
                slot.offload()
        # each slot dropped its gradient's pages; this drops those read between passes
        for home in {id(s.home): s.home for s in self._slots}.values():
            home.release()
        self.return_freed()

    def evict(self) -> None:
        """After a failed run: parameters back on the store, the gradients made since the
        load dropped (those held before kept)."""
        if not self.resident:
            return
        for slot in self._slots:
            slot.parameter.grad = None
        self.offload()

    def adopt_state(self, optimizer: torch.optim.Optimizer, ids: set[int] | None = None) -> None:
        """Move the optimizer's state of the parameters stored here (those whose ids are in
        ``ids``, where given) into the store, where later steps update it in place."""
        with torch.no_grad():
            for slot in self._own:
                if ids is None or id(slot.parameter) in ids:
                    slot.adopt_state(optimizer)

    def return_freed(self, ids: set[int] | None = None) -> None:
        """After the stage's working copies and gradients (or the optimizer's private state
        of the parameters whose ids are in ``ids``) were freed: the allocator's free pages
        back to the system where that is :data:`~pipetrain.distributed.heap.FREE_KEPT_BYTES`
        or more. Smaller stages' come and go in memory the allocator reuses, and handing
        it back would fault it in again at every load (9% of a step measured)."""
        slots = self._own if ids is None else [s for s in self._own if id(s.parameter) in ids]
        if 2 * sum(_nbytes(slot.parameter) for slot in slots) >= FREE_KEPT_BYTES:
            return_freed_memory()

    def parts(self) -> list[set[int]]:
        """The ids of the parameters stored here in parts that lie together in the
        regions, each of at most :data:`PART_BYTES` or the largest parameter's bytes: an
        optimizer steps a part at a time, so the step touches that much of each region,
        and its first step makes that much state in private memory, before the part's
        pages are released."""
        if self._parts is None:
            largest = max((_nbytes(slot.parameter) for slot in self._own), default=0)
            budget = max(largest, PART_BYTES)
            self._parts, used = [], budget
            for slot in self._own:
                if used + _nbytes(slot.parameter) > budget:
                    self._parts.append(set())
                    used = 0
                self._parts[-1].add(id(slot.parameter))
                used += _nbytes(slot.parameter)
        return self._parts

    def stored_ids(self) -> set[int]:
        """The ids of the parameters stored here (not those shared from another stage)."""
        return {id(slot.parameter) for slot in self._own}

    def used_ids(self) -> set[int]:
        """The ids of every parameter the stage uses (those shared from another included)."""
        return {id(slot.parameter) for slot in self._slots}

    def stored_views(self, kind: str | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each parameter stored here with its tensor in the master weights (``None``) or
        in the region of ``kind`` (see :meth:`region`)."""
        region = self.master if kind is None else self.region(kind)
        return [(slot.parameter, region.view(slot.offset, slot.parameter)) for slot in self._own]

    def release(self, ids: set[int] | None = None) -> None:
        """Drop every region's pages (those of the parameters whose ids are in ``ids``,
        stored here, where given) from this process's resident set."""
        if ids is None:
            for region in self.regions():
                region.release()
            return
        slots = [slot for slot in self._own if id(slot.parameter) in ids]
        start = min(slot.offset for slot in slots)
        end = max(slot.offset + _nbytes(slot.parameter) for slot in slots)
        for region in self.regions():
            region.release(start, end - start)


def step_only(optimizer: torch.optim.Optimizer, ids: set[int]) -> None:
    """``optimizer.step()`` over the parameters whose ids are in ``ids`` alone, its param
    groups cut to them for the step (each parameter's update depends on it alone)."""
    groups = [group["params"] for group in optimizer.param_groups]
    try:
        for group, params in zip(optimizer.param_groups, groups):
            group["params"] = [p for p in params if id(p) in ids]
        optimizer.step()
    finally:
        for group, params in zip(optimizer.param_groups, groups):
            group["params"] = params


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _like(value: object, parameter: torch.Tensor) -> bool:
    """Whether optimizer state ``value`` is a tensor laid out as ``parameter`` in the store."""
    return (
        isinstance(value, torch.Tensor)
        and value.dim() > 0
        and value.shape == parameter.shape
        and value.dtype == parameter.dtype
        and value.device.type == "cpu"
    )


class HostWeights:
    """The stages of this rank whose weights live in the host store, by stage index."""

    def __init__(self, device: torch.device) -> None:
        """Stages will be loaded onto ``device``."""
        self.device = device
        self.stages: dict[int, StoredStage] = {}
        self._slots: dict[int, _Slot] = {}  # every stored parameter, by id

    def adopt(self, index: int, module: nn.Module) -> None:
        """Move stage ``index``'s parameters (just materialized) into the store."""
        self.stages[index] = StoredStage(index, module, self.device, self._slots)

    def load(self, stage: int) -> None:
        """``LOAD`` of ``stage``."""
        self.stages[stage].load()

    def offload(self, stage: int) -> None:
        """``OFFLOAD`` of ``stage``."""
        self.stages[stage].offload()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's step, one stage at a time (each parameter's update depends on it
        alone), each stage's new state moved into the store and its pages released before
        the next: the step holds one stage's weights, gradients and state at once."""
        for stored in self.stages.values():
            self.step_stage(optimizer, stored)

    def step_stage(self, optimizer: torch.optim.Optimizer, stored: StoredStage) -> None:
        """The optimizer's step of the parameters stored in ``stored`` alone, in the
        stage's parts (:meth:`StoredStage.parts`): each part's new state moved into the
        store and its pages released before the next."""
        for part in stored.parts():
            step_only(optimizer, part)
            stored.adopt_state(optimizer, part)
            stored.release(part)
            stored.return_freed(part)  # the part's private state and temporaries

    # a one-step-stale store (:mod:`.stale_store`) defers each step; this one steps at once
    defers = False
    """Whether an update's step waits for the next update."""

    def begin(self, lane: Sequence[Action], updating: bool) -> None:
        """Before a run of ``lane`` (updating or not)."""

    def check_saving(self) -> None:
        """Raise where a checkpoint could not keep what the store holds."""

    def flush(self) -> None:
        """Apply a step that waits, now."""

    def drop_pending(self) -> None:
        """Forget a step that waits (the weights were replaced)."""

    def settle(self, optimizer: torch.optim.Optimizer | None) -> None:
        """After a run or an update outside one: any stage left resident by a failure put
        back, the optimizer's new state moved into the store, every region released."""
        for stored in self.stages.values():
            stored.evict()
        for stored in self.stages.values():
            if optimizer is not None:
                stored.adopt_state(optimizer)
            stored.release()
