"""A host store whose optimizer step runs one update late (``roundpipe`` with ``stale``).

Update k's step is not applied when its gradients are complete: its gradients (clipped,
unscaled, divided by the step's count: everything an update does before the optimizer)
are copied into a region of the store of their own, with the optimizer's hyperparameters
of update k (the learning rate before the scheduler's step), and the step is applied
during update k + 1, to each stage once this rank's last ``LOAD`` of update k + 1 that
reads its weights has copied them: every pass of update k + 1 computes on the weights from
before update k's step. Per stage, with g(w) the gradients of an update's batches at w:

    w_{t+1} = step(w_t, g(w_{t-1})),   w_{-1} = w_0

(PipeDream-2BW's delay-1 rule). Here the step runs on the worker's thread right after that
``LOAD`` copied the weights (on a GPU the worker's copy is on the device, so the host's
step could overlap the stage's passes; on a CPU there is nothing to overlap it with).

Everything an update does before its optimizer step still happens at the end of update k,
on update k's gradients: the global norm and clipping by it, the fp16 unscale and overflow
check (an overflowed or non-finite update is skipped, its scale backed off at once, and
leaves no step waiting), a pair loss's division by the step's count. The scheduler steps
then too; the waiting step uses the hyperparameters kept with it. So every policy is exact
under the rule, and ``Pipeline.updates`` counts an update once its step waits.

Only an updating run applies a waiting step: an accumulating call
(``train_step(update=False)``) and an evaluation read the weights without it, and a step
still waiting when the next update's is deferred (``Pipeline.update()`` after accumulating
calls, a stage no ``LOAD`` reads) is applied first. :meth:`StaleHostWeights.flush` applies
it at once (``Pipeline.update()`` with nothing accumulated; nothing waiting is then no
error): a checkpoint does not keep a waiting step, so saving is refused while one waits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pipetrain.runtime.rank.stored_stage import HostWeights
from pipetrain.schedules import Action, Kind

PENDING = "pending-grads"  # the region of a deferred step's gradients


class StaleHostWeights(HostWeights):
    """A rank's stored stages whose optimizer step is applied during the next update."""

    defers = True

    def __init__(self, device: torch.device) -> None:
        """Stages will be loaded onto ``device``."""
        super().__init__(device)
        self._waiting: set[int] = set()  # stages whose step waits
        self._hyper: list[dict[str, Any]] = []  # the waiting step's param-group settings
        self._optimizer: torch.optim.Optimizer | None = None
        self._loads_left: Counter[int] = Counter()  # an updating run's LOADs still to come
        self._updating = False
        self._gradless: set[int] = set()  # parameters (ids) the waiting step has no gradient
        self._readers: dict[int, list[int]] = {}  # found at the first run's loads

    def begin(self, lane: Sequence[Action], updating: bool) -> None:
        """Before a run of ``lane``: an updating run applies the waiting step of each stage
        after the last ``LOAD`` that reads its weights."""
        self._updating = updating
        self._loads_left = Counter(a.stage for a in lane if a.kind is Kind.LOAD)

    def load(self, stage: int) -> None:
        """``LOAD`` of ``stage``; then the waiting steps of the stages whose weights no
        later ``LOAD`` of the run reads."""
        super().load(stage)
        self._loads_left[stage] -= 1
        if not self._updating or self._optimizer is None:
            return
        for index in sorted(self._waiting):
            if not any(self._loads_left[j] > 0 for j in self._readers_of(index)):
                self._apply(index)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The update's step, deferred: any step still waiting applied first, then this
        update's gradients and hyperparameters kept for the next update."""
        self.flush()
        self._gradless.clear()
        with torch.no_grad():
            for index, stored in self.stages.items():
                if not stored.stored_ids():
                    continue
                for parameter, kept in stored.stored_views(PENDING):
                    if parameter.grad is None:
                        self._gradless.add(id(parameter))
                    else:
                        kept.copy_(parameter.grad)
                stored.region(PENDING).release()
                self._waiting.add(index)
        self._optimizer = optimizer
        self._hyper = [
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in group.items()}
            for group in optimizer.param_groups
        ]

    @property
    def pending(self) -> bool:
        """Whether an update's step waits to be applied."""
        return bool(self._waiting)

    def check_saving(self) -> None:
        """Refuse a checkpoint while a step waits: it would not keep the step."""
        if self._waiting:
            raise RuntimeError(
                "the last update's step waits for the next update (roundpipe with stale=True) "
                "and a checkpoint does not keep it; call update() to apply it, then save"
            )

    def flush(self) -> None:
        """Apply every step that waits, now."""
        for index in sorted(self._waiting):
            self._apply(index)

    def drop_pending(self) -> None:
        """Forget the waiting steps (the weights were replaced)."""
        self._waiting.clear()

    def _readers_of(self, index: int) -> list[int]:
        """The stages whose ``LOAD`` reads parameters stored with stage ``index``."""
        if index not in self._readers:
            own = self.stages[index].stored_ids()
            found = [j for j, stored in self.stages.items() if stored.used_ids() & own]
            self._readers[index] = found
        return self._readers[index]

    def _apply(self, index: int) -> None:
        """Stage ``index``'s waiting step on the store's weights, with the gradients and
        hyperparameters of its update, a part of the stage at a time
        (:meth:`~.stored_stage.StoredStage.parts`). The optimizer steps stand-ins of the
        parameters on the store's tensors (their state lent to them): a loaded stage's
        parameters, whose forwards' graphs wait for their backwards, are not written to."""
        self._waiting.discard(index)
        stored, optimizer = self.stages[index], self._optimizer
        assert optimizer is not None  # set by the step that made it wait
        state = optimizer.state
        stand_ins: dict[int, nn.Parameter] = {}
        parameters: dict[int, torch.Tensor] = {}
        for (parameter, master), (_, kept) in zip(
            stored.stored_views(), stored.stored_views(PENDING)
        ):
            stand_in = nn.Parameter(master, requires_grad=parameter.requires_grad)
            stand_in.grad = None if id(parameter) in self._gradless else kept
            stand_ins[id(parameter)] = stand_in
            parameters[id(parameter)] = parameter
        groups = optimizer.param_groups
        kept_groups = [dict(group) for group in groups]
        try:
            for group, hyper in zip(groups, self._hyper):
                group.update(hyper)
            for part in stored.parts():
                _lend(state, [(parameters[i], stand_ins[i]) for i in part])
                try:
                    for group, hyper in zip(groups, self._hyper):
                        group["params"] = [
                            stand_ins[id(p)] for p in hyper["params"] if id(p) in part
                        ]
                    with torch.no_grad():
                        optimizer.step()
                finally:
                    _lend(state, [(stand_ins[i], parameters[i]) for i in part])
                stored.adopt_state(optimizer, part)
                stored.release(part)
                stored.return_freed(part)  # the part's private state and temporaries
        finally:
            for group, kept_group in zip(groups, kept_groups):
                group.clear()
                group.update(kept_group)


def _lend(state: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Move each ``(owner, borrower)`` pair's optimizer state from owner to borrower."""
    for owner, borrower in pairs:
        if owner in state:
            state[borrower] = state.pop(owner)
