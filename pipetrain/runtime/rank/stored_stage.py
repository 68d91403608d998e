"""Stages whose weights live in the host store, loaded onto the worker for their passes.

Between a stage's ``OFFLOAD`` and its next ``LOAD`` its module's parameters *are* views of
the store (``param.data`` is the store's fp32 master tensor, ``param.grad`` the store's
gradient), so everything that reads or writes them between passes (the update cycle's
optimizer step, clipping, the norm, loss scaling and pair-loss normalization, a checkpoint's
save and load, ``state_dict``) works on the store in place, unchanged, and the optimizer's
parameters are the store's tensors. ``LOAD`` copies the master into a private tensor of the
worker's and points the parameter at it; ``OFFLOAD`` adds the gradients the stage's
backwards made into the store's gradient, points the parameter back at the store and
frees the private tensor's storage (``untyped_storage().resize_(0)``, as FSDP does): the
autograd graph of forwards whose backwards come later keeps that storage object, which
the next ``LOAD`` fills again. Buffers stay in the module (they are small).

The optimizer's state is made by its first step in private memory and then moved into the
store (:meth:`HostWeights.settle`), where later steps update it in place. After each use
a stage's regions are released, so a worker's resident memory holds the stages it has
loaded, not its share of the model.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from pipetrain.runtime.rank.host_store import Region, aligned


class StoredStage:
    """One stage's parameters in the host store: a region for the master weights, one for
    their gradients and one per kind of optimizer state, laid out alike."""

    def __init__(self, index: int, module: nn.Module, device: torch.device) -> None:
        """Copy ``module``'s parameters into the store and point them at it; ``LOAD``
        allocates their working copies on ``device``."""
        self.index, self.device = index, device
        self.parameters = list({id(p): p for p in module.parameters()}.values())
        self.offsets, total = [], 0
        for parameter in self.parameters:
            self.offsets.append(total)
            total += aligned(parameter.numel() * parameter.element_size())
        self._nbytes = total
        self.master = Region(f"stage{index}-weights", total)
        self._grads: Region | None = None
        self._states: dict[str, Region] = {}
        self._private: list[torch.Tensor | None] = [None] * len(self.parameters)
        self._held: list[torch.Tensor | None] = [None] * len(self.parameters)
        self._lent: list[weakref.ref[torch.Tensor] | None] = [None] * len(self.parameters)
        self.resident = False
        with torch.no_grad():
            for parameter, view in zip(self.parameters, self._views(self.master)):
                view.copy_(parameter)
                parameter.data = view
        self.master.release()

    def _views(self, region: Region) -> list[torch.Tensor]:
        return [region.view(o, p) for o, p in zip(self.offsets, self.parameters)]

    def _region(self, kind: str) -> Region:
        """The region of gradients (``"grads"``) or of one kind of optimizer state."""
        if kind == "grads":
            if self._grads is None:
                self._grads = Region(f"stage{self.index}-grads", self._nbytes)
            return self._grads
        if kind not in self._states:
            name = f"stage{self.index}-state{len(self._states)}"
            self._states[kind] = Region(name, self._nbytes)
        return self._states[kind]

    def regions(self) -> list[Region]:
        """Every region of the stage."""
        extra = [] if self._grads is None else [self._grads]
        return [self.master, *extra, *self._states.values()]

    def load(self) -> None:
        """``LOAD``: the master weights copied into working tensors the parameters hold;
        gradients already in the store are set aside for :meth:`offload` to add to."""
        masters = self._views(self.master)
        with torch.no_grad():
            for i, (parameter, master) in enumerate(zip(self.parameters, masters)):
                private = self._private[i]
                if private is None:
                    private = self._private[i] = torch.empty_like(master, device=self.device)
                else:  # the storage a pending backward's graph may hold: filled again
                    private.untyped_storage().resize_(master.numel() * master.element_size())
                private.copy_(master)
                self._held[i], parameter.grad = parameter.grad, None
                parameter.data = private
        self.resident = True
        self.master.release()

    def offload(self) -> None:
        """``OFFLOAD``: the gradients made since :meth:`load` added into the store's, the
        parameters pointed back at the store and the working tensors freed."""
        masters = self._views(self.master)
        with torch.no_grad():
            for i, (parameter, master) in enumerate(zip(self.parameters, masters)):
                grad, parameter.grad = self._gradient(i, parameter.grad), None
                parameter.data = master
                parameter.grad = grad
                private = self._private[i]
                assert private is not None  # allocated by the LOAD before
                private.untyped_storage().resize_(0)
        self.resident = False
        self.master.release()
        if self._grads is not None:
            self._grads.release()

    def _gradient(self, i: int, made: torch.Tensor | None) -> torch.Tensor | None:
        """Parameter ``i``'s gradient after an offload: what it held before the load plus
        ``made``, in the store where the store's tensor is free."""
        held, self._held[i] = self._held[i], None
        if made is None:
            return held
        if held is not None:
            return held.add_(made.to(held.device))
        lent = self._lent[i]
        if lent is not None and lent() is not None:
            # the store's gradient was taken off the parameter but is still in use (put
            # aside by the pair-loss normalization): this one stays in private memory
            return made
        stored = self._region("grads").view(self.offsets[i], self.parameters[i])
        stored.copy_(made)
        self._lent[i] = weakref.ref(stored)
        return stored

    def evict(self) -> None:
        """After a failed run: parameters back on the store, the gradients made since the
        load dropped (those held before kept)."""
        if not self.resident:
            return
        for parameter in self.parameters:
            parameter.grad = None
        self.offload()

    def adopt_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Move the optimizer's state of the stage's parameters (each tensor shaped as its
        parameter) into the store, where later steps update it in place."""
        with torch.no_grad():
            for i, parameter in enumerate(self.parameters):
                if parameter not in optimizer.state:
                    continue
                state = optimizer.state[parameter]
                for key, value in list(state.items()):
                    if not _like(value, parameter):
                        continue
                    stored = self._region(f"state:{key}").view(self.offsets[i], parameter)
                    if value.data_ptr() != stored.data_ptr():
                        stored.copy_(value)
                        state[key] = stored

    def release(self) -> None:
        """Drop every region's pages from this process's resident set."""
        for region in self.regions():
            region.release()


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
        self._owners: dict[int, int] = {}  # id of a parameter -> the stage storing it

    def adopt(self, index: int, module: nn.Module) -> None:
        """Move stage ``index``'s parameters (just materialized) into the store."""
        for name, parameter in module.named_parameters():
            owner = self._owners.get(id(parameter))
            if owner is not None:
                raise ValueError(
                    f"parameter {name!r} is used by stages {owner} and {index}, both on one "
                    "rank under a host-stored schedule, which keeps one copy per stage; cut "
                    "the model so that they fall on different ranks (another model_stages)"
                )
        self.stages[index] = StoredStage(index, module, self.device)
        self._owners.update({id(p): index for p in self.stages[index].parameters})

    def load(self, stage: int) -> None:
        """``LOAD`` of ``stage``."""
        self.stages[stage].load()

    def offload(self, stage: int) -> None:
        """``OFFLOAD`` of ``stage``."""
        self.stages[stage].offload()

    def settle(self, optimizer: torch.optim.Optimizer | None) -> None:
        """After a run or an update outside one: any stage left resident by a failure put
        back, the optimizer's new state moved into the store, every region released."""
        for stored in self.stages.values():
            stored.evict()
            if optimizer is not None:
                stored.adopt_state(optimizer)
            stored.release()
