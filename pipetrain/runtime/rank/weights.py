"""Weight versions and optimizer updates of the stages one rank holds.

Synchronous schedules run every stage on its live parameters and update once all of the
rank's stages have stepped (unless the run only accumulates gradients); the
:class:`~pipetrain.runtime.rank.update.Updater` decides what an update does around the
optimizer. Asynchronous ones (PipeDream, PipeDream-2BW) stash weight versions: each
version a stage still needs is a detached snapshot of its parameters; a forward runs the
stage module through :func:`torch.func.functional_call` on the snapshot its action names,
so its backward differentiates exactly those weights; the optimizer updates the live
parameters, which no graph has saved, and the result becomes the next snapshot.
Nothing is swapped in place under autograd.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from pipetrain.runtime.rank.update import PendingUpdate, Updater
from pipetrain.schedules import COMPUTE_KINDS, Action, Kind


class WeightStash:
    """The weight versions of one stage; version ``v`` is the weights after ``v`` updates."""

    def __init__(self, module: nn.Module) -> None:
        """Start with the module's current weights as the newest version."""
        self.module = module
        self.live = dict(module.named_parameters())
        # buffers (such as running statistics) are shared by every version and updated in place
        self.buffers = dict(module.named_buffers())
        self.newest = 0
        self.versions: dict[int, dict[str, torch.Tensor]] = {0: self._snapshot()}

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {
            name: p.detach().clone().requires_grad_(p.requires_grad)
            for name, p in self.live.items()
        }

    def run(self, version: int, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Run the stage on weight ``version``; gradients will accumulate on that version."""
        if version not in self.versions:
            raise RuntimeError(
                f"weight version {version} is no longer stashed (kept: {sorted(self.versions)})"
            )
        return torch.func.functional_call(
            self.module, {**self.versions[version], **self.buffers}, inputs
        )

    def trainable(self, version: int) -> list[torch.Tensor]:
        """Version ``version``'s tensors of the trainable parameters, in the module's order."""
        weights = self.versions[version]
        return [weights[name] for name, parameter in self.live.items() if parameter.requires_grad]

    def load_gradients(self) -> None:
        """Add the gradients of the backwards since the last call, whatever versions they
        used, to the live parameters' ``.grad``, and clear them from the versions."""
        for name, parameter in self.live.items():
            for weights in self.versions.values():
                grad = weights[name].grad
                if grad is not None:
                    parameter.grad = grad if parameter.grad is None else parameter.grad + grad
        for weights in self.versions.values():
            for tensor in weights.values():
                tensor.grad = None

    def advance(self) -> None:
        """Record the live weights (just updated) as the next version."""
        self.newest += 1
        self.versions[self.newest] = self._snapshot()

    def reset(self) -> None:
        """Make the live weights (loaded from outside) the only version, keeping its number."""
        self.versions = {self.newest: self._snapshot()}

    def keep_only(self, needed: Iterable[int]) -> None:
        """Drop every version that is neither needed later nor the newest."""
        keep = set(needed) | {self.newest}
        for version in [v for v in self.versions if v not in keep]:
            del self.versions[version]


class Weights:
    """The weights of this rank's stages, their versions, and the optimizer that updates them.

    ``modules`` maps each held stage to its module. Versions in a schedule count from the
    start of its window (one call of the pipeline); :meth:`begin` maps them to the stash's
    absolute versions and notes which versions each update must keep.
    """

    def __init__(
        self,
        modules: Mapping[int, nn.Module],
        optimizer: torch.optim.Optimizer | None,
        asynchronous: bool,
        updater: Updater | None = None,
        share: Callable[[int], None] | None = None,
    ) -> None:
        """Hold ``modules``; step ``optimizer`` (if any) synchronously or, with
        ``asynchronous``, at every stage's update on stashed versions. ``updater`` applies
        the updates (by default: the optimizer's step alone); ``share(stage)`` sums an
        asynchronous stage's parts of parameters other stages share before its update."""
        self.modules = dict(modules)
        self.share = share
        self.updater = updater if updater is not None else Updater(optimizer)
        self.asynchronous = asynchronous
        self.updating = True
        self.stashes = (
            {stage: WeightStash(module) for stage, module in self.modules.items()}
            if asynchronous
            else {}
        )
        self._trainable: dict[int, list[torch.Tensor]] = {
            stage: [p for p in module.parameters() if p.requires_grad]
            for stage, module in self.modules.items()
        }
        self._steps = dict.fromkeys(self.modules, 0)
        self._applied = dict.fromkeys(self.modules, 0)  # asynchronous updates made
        self._window_steps: Counter[int] = Counter()
        self._pending: dict[int, deque[PendingUpdate]] = {s: deque() for s in self.modules}
        self._base = dict.fromkeys(self.modules, 0)
        self._needed: dict[int, list[set[int]]] = {stage: [] for stage in self.modules}

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer of this rank's parameters (``None`` without one)."""
        return self.updater.optimizer

    def begin(self, lane: Sequence[Action], update: bool = True) -> None:
        """Start a window of this rank's actions ``lane``: versions count from here, and
        each update keeps only the versions later actions use. Without ``update`` (only
        synchronously) the window's ``STEP``s and all-reduces leave the gradients to
        accumulate over windows."""
        if not update and self.asynchronous:
            raise ValueError("an asynchronous schedule updates inside every window")
        self.updating = update
        self._steps = dict.fromkeys(self.modules, 0)
        self._applied = dict.fromkeys(self.modules, 0)
        self._window_steps = Counter(a.stage for a in lane if a.kind is Kind.STEP)
        for pending in self._pending.values():
            pending.clear()  # only a failed window leaves any
        self._base = {stage: stash.newest for stage, stash in self.stashes.items()}
        # needed[stage][j]: absolute versions used after the stage's j-th update in the window,
        # built from the window's end (last update first), then put in update order
        self._needed = {stage: [] for stage in self.modules}
        for action in reversed(lane):
            if action.stage not in self.stashes:
                continue
            needed = self._needed[action.stage]
            if action.kind is Kind.STEP:
                needed.append(set(needed[-1]) if needed else set())
            elif action.kind in COMPUTE_KINDS and action.version is not None:
                if not needed:
                    needed.append(set())
                needed[-1].add(self._base[action.stage] + action.version)
        for needed in self._needed.values():
            needed.reverse()

    def version(self, stage: int, scheduled: int | None) -> int | None:
        """The stash's version for a schedule's version ``scheduled`` of ``stage`` (``None``:
        the live weights)."""
        if scheduled is None or not self.asynchronous:
            return None
        return self._base[stage] + scheduled

    def run(
        self, stage: int, version: int | None, inputs: Sequence[torch.Tensor]
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The stage's output on ``inputs`` with weight ``version`` (``None``: the live weights)."""
        if version is None:
            return self.modules[stage](*inputs)
        pending = self._pending[stage]
        while pending and version > self.stashes[stage].newest:
            self._apply_pending(stage)
        return self.stashes[stage].run(version, *inputs)

    def holders(self, stage: int, version: int | None) -> list[torch.Tensor]:
        """The tensors a backward on ``version`` accumulates the stage's gradients in; for
        ``None``, those of the current weights (the newest version when stashing)."""
        if not self.asynchronous:
            return self._trainable[stage]
        stash = self.stashes[stage]
        return stash.trainable(stash.newest if version is None else version)

    def collect(self, stage: int) -> None:
        """Move a stage's gradients from the versions the backwards used to the live
        parameters (after an all-reduce wrote them there)."""
        if self.asynchronous:
            self.stashes[stage].load_gradients()

    def step(
        self,
        stage: int,
        loss: torch.Tensor | None = None,
        normalize: Callable[[torch.Tensor], float] | None = None,
    ) -> None:
        """Apply ``stage``'s update: synchronously, the rank's update happens once every
        held stage has stepped (``loss``, this rank's share of the step's loss, is checked
        with the gradients, which ``normalize`` divides: see :meth:`Updater.apply`);
        asynchronously, at once, and the new weights become the next version."""
        self._steps[stage] += 1
        if not self.asynchronous:
            if self.updating and sum(self._steps.values()) == len(self.modules):
                self.updater.apply(loss, normalize)
            return
        stash = self.stashes[stage]
        stash.load_gradients()
        if self.share is not None:
            self.share(stage)
        live = list(stash.live.values())
        if not self.updater.defers:
            self.updater.step_local(live, stage)
            self._advance(stage)
            return
        self._pending[stage].append(self.updater.defer(live))
        if self._steps[stage] == self._window_steps[stage]:  # the window ends applied
            while self._pending[stage]:
                self._apply_pending(stage)

    def _apply_pending(self, stage: int) -> None:
        """Apply ``stage``'s oldest deferred update."""
        live = list(self.stashes[stage].live.values())
        self.updater.apply_deferred(self._pending[stage].popleft(), live, stage)
        self._advance(stage)

    def _advance(self, stage: int) -> None:
        """Count an applied asynchronous update and make its weights the next version."""
        self._applied[stage] += 1
        if min(self._applied.values()) == self._applied[stage]:
            self.updater.finish()  # every held stage has made this update
        stash = self.stashes[stage]
        # applied: left in place, a later update of another stage here would apply them again
        for parameter in stash.live.values():
            parameter.grad = None
        stash.advance()
        later = self._needed[stage]
        index = self._applied[stage]
        # a deferred update is applied after its STEP: what later STEPs need is a superset
        stash.keep_only(later[index] if index < len(later) else ())

    def reset(self) -> None:
        """Make the live weights (just loaded) the only version of every stage."""
        for stash in self.stashes.values():
            stash.reset()
