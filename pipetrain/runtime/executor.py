"""Execute one rank's action list: forwards, backwards, weight gradients, transfers, steps.

The executor knows nothing about how the schedule was chosen; it plays the actions in
order. Tensors that cross a stage boundary enter the next stage as fresh leaves, so each
stage's autograd graph ends at its own inputs and gradients travel as messages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pipetrain.runtime.recompute import RandomState, recompute, recomputes
from pipetrain.runtime.recorder import Recorder
from pipetrain.runtime.reduce import GradientReducer
from pipetrain.runtime.stash import WeightStash
from pipetrain.runtime.transport import PeerError, PendingReceive, Transport
from pipetrain.schedules import RECV_KINDS, Action, Kind, Schedule

Tensors = tuple[torch.Tensor, ...]


def as_tuple(value: torch.Tensor | Sequence[torch.Tensor]) -> Tensors:
    """A stage output as a tuple of tensors."""
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)


def as_leaves(tensors: Tensors) -> Tensors:
    """Detached copies of boundary tensors; floating ones require grad so their gradient can be sent back."""
    return tuple(
        t.detach().requires_grad_(True) if t.is_floating_point() else t.detach() for t in tensors
    )


@dataclass
class _Slot:
    """What a stage keeps for one micro-batch between its forward and its backward."""

    inputs: Tensors
    outputs: Tensors | None  # None while recomputing (recomputed at the backward)
    version: int | None = None  # absolute weight version (asynchronous schedules)
    random_state: RandomState | None = None
    loss: torch.Tensor | None = None
    # set by a split backward for the weight-gradient pass
    differentiable: Tensors = ()
    output_grads: Tensors = ()


class ActionFailed(RuntimeError):
    """An action raised on this rank; names the rank, stage and action."""

    def __init__(self, rank: int, action: Action, error: BaseException) -> None:
        """Wrap ``error`` raised while running ``action`` on ``rank``."""
        super().__init__(
            f"rank {rank} (stage {action.stage}) failed at {action}: {type(error).__name__}: {error}"
        )
        self.rank, self.stage, self.action = rank, action.stage, action


class Executor:
    """Runs ``schedule.ranks[rank]`` against the stage modules this rank holds."""

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        modules: dict[int, nn.Module],
        transport: Transport,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        recompute: str,
        recorder: Recorder,
        step: Callable[[int], None],
        reducers: dict[int, GradientReducer] | None = None,
        stashes: dict[int, WeightStash] | None = None,
    ) -> None:
        """Prepare to run; ``step(stage)`` applies the optimizer to one stage's weights;
        ``reducers`` all-reduce the gradients of this rank's replicated stages over their
        replicas; ``stashes`` hold each stage's weight versions when the schedule is
        asynchronous."""
        self.schedule, self.rank, self.modules = schedule, rank, modules
        self.transport, self.loss_fn, self.recompute_mode = transport, loss_fn, recompute
        self.recorder, self.step = recorder, step
        self.reducers = reducers or {}
        self.stashes = stashes or {}
        self._trainable = {
            stage: [p for p in module.parameters() if p.requires_grad]
            for stage, module in modules.items()
        }
        self._prefetch = transport.device.type == "cuda"
        self.last_stage = schedule.stages - 1
        self._handlers = {
            Kind.FORWARD: self._forward,
            Kind.BACKWARD: self._backward,
            Kind.WEIGHT: self._weight,
            Kind.SEND_F: self._send_activation,
            Kind.SEND_B: self._send_gradient,
            Kind.RECV_F: self._receive_activation,
            Kind.RECV_B: self._receive_gradient,
            Kind.STEP: self._step,
            Kind.ALLREDUCE: self._allreduce,
        }

    def run(
        self,
        inputs: Sequence[Tensors] | None,
        targets: Sequence[torch.Tensor] | None,
        scales: Sequence[float] | None,
    ) -> torch.Tensor | None:
        """Play the rank's actions for one mini-batch; return the summed loss on last-stage ranks."""
        self._inputs, self._targets, self._scales = inputs, targets, scales
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._activations: dict[
            tuple[int, int], Tensors
        ] = {}  # outputs waiting to be sent or used locally
        self._received: dict[tuple[int, int], Tensors] = {}  # inputs of (stage, mb)
        self._output_grads: dict[
            tuple[int, int], Tensors
        ] = {}  # gradients of (stage, mb)'s outputs
        self._input_grads: dict[tuple[int, int], Tensors] = {}  # gradients of (stage, mb)'s inputs
        self._loss: torch.Tensor | None = None
        self.outputs: dict[
            int, Tensors
        ] = {}  # last stage's outputs by micro-batch, kept when there are no targets
        self._prepare_versions()
        actions = self.schedule.ranks[self.rank]
        self._receives = [a for a in actions if a.kind in RECV_KINDS]
        self._next_receive = 0
        self._posted: dict[tuple[Kind, int, int], PendingReceive] = {}
        self._busy_peers: set[int] = set()
        self._post_receives()
        self._arming = self._last_gradient_passes(actions) if self.reducers else set()
        recorder = self.recorder
        for action in actions:
            start = recorder.now() if recorder.enabled else 0.0
            try:
                self._handlers[action.kind](action)
            except (ActionFailed, PeerError):
                raise
            except Exception as error:
                raise ActionFailed(self.rank, action, error) from error
            if recorder.enabled:
                recorder.add(
                    action.kind.value, action.stage, action.microbatch, start, recorder.now()
                )
        return self._loss

    # gradient all-reduce --------------------------------------------------------------
    def _last_gradient_passes(self, actions: Sequence[Action]) -> set[tuple[int, int]]:
        """(stage, micro-batch) of the passes that complete a replicated stage's weight
        gradients for an update: its last backward (or weight pass) before each all-reduce."""
        gradient_kind = Kind.WEIGHT if self.schedule.split_backward else Kind.BACKWARD
        last: dict[int, int] = {}
        found = set()
        for action in actions:
            if action.kind is gradient_kind and action.stage in self.reducers:
                last[action.stage] = action.microbatch
            elif action.kind is Kind.ALLREDUCE and action.stage in last:
                found.add((action.stage, last.pop(action.stage)))
        return found

    def _gradient_holders(self, stage: int, version: int | None) -> list[torch.Tensor]:
        """The tensors a backward on weight ``version`` accumulates the stage's gradients in."""
        return self._trainable[stage] if version is None else self.stashes[stage].trainable(version)

    def _arm_if_last(self, stage: int, microbatch: int, version: int | None) -> None:
        """Before an update's last gradient pass, let it start the all-reduce of each bucket
        it completes."""
        if (stage, microbatch) in self._arming:
            self.reducers[stage].arm(self._gradient_holders(stage, version))

    def _allreduce(self, action: Action) -> None:
        stage = action.stage
        stash = self.stashes[stage] if self._stashing else None
        self.reducers[stage].finish(self._gradient_holders(stage, stash.newest if stash else None))
        if stash:
            # the gradients sat on the stashed versions the backwards used: now on the live weights
            stash.load_gradients()
            self._loaded.add(stage)

    # weight versions ------------------------------------------------------------------
    def _prepare_versions(self) -> None:
        """Schedule versions count from this window's start; note which each update must keep."""
        self._stashing = self.schedule.asynchronous and bool(self.stashes)
        if not self._stashing:
            return
        self._base = {stage: stash.newest for stage, stash in self.stashes.items()}
        self._loaded: set[int] = set()  # stages whose gradients an all-reduce already loaded
        self._steps_done = dict.fromkeys(self.stashes, 0)
        # needed[stage][j]: absolute versions used after the stage's j-th update in this window
        self._needed: dict[int, list[set[int]]] = {stage: [] for stage in self.stashes}
        for action in reversed(self.schedule.ranks[self.rank]):
            needed = self._needed[action.stage]
            if action.kind is Kind.STEP:
                needed.insert(0, set(needed[0]) if needed else set())
            elif action.version is not None and action.kind in (
                Kind.FORWARD,
                Kind.BACKWARD,
                Kind.WEIGHT,
            ):
                if not needed:
                    needed.insert(0, set())
                needed[0].add(self._base[action.stage] + action.version)

    def _step(self, action: Action) -> None:
        stage = action.stage
        if not self._stashing:
            self.step(stage)
            return
        stash = self.stashes[stage]
        if stage not in self._loaded:
            stash.load_gradients()
        self._loaded.discard(stage)
        self.step(stage)
        stash.advance()
        self._steps_done[stage] += 1
        later = self._needed[stage]
        index = self._steps_done[stage]
        stash.keep_only(later[index] if index < len(later) else ())

    # forward --------------------------------------------------------------------------
    def _stage_inputs(self, stage: int, microbatch: int) -> Tensors:
        if stage == 0:
            return self._inputs[microbatch]
        key = (stage - 1, microbatch)
        if key in self._activations:  # the previous stage lives on this rank
            return as_leaves(self._activations.pop(key))
        return as_leaves(self._received.pop((stage, microbatch)))

    def _run_stage(
        self, stage: int, microbatch: int, inputs: Tensors, version: int | None
    ) -> tuple[Tensors, torch.Tensor | None]:
        if version is None:
            outputs = as_tuple(self.modules[stage](*inputs))
        else:
            outputs = as_tuple(self.stashes[stage].run(version, *inputs))
        if stage != self.last_stage or self._targets is None:
            return outputs, None
        output = outputs[0] if len(outputs) == 1 else outputs
        loss = self.loss_fn(output, self._targets[microbatch]) * self._scales[microbatch]
        return outputs, loss

    def _forward(self, action: Action) -> None:
        stage, mb = action.stage, action.microbatch
        inputs = self._stage_inputs(stage, mb)
        version = self._base[stage] + action.version if self._stashing else None
        if recomputes(self.recompute_mode, mb, self.schedule.microbatches):
            random_state = RandomState(inputs[0].device if inputs else torch.device("cpu"))
            with torch.no_grad():
                outputs, loss = self._run_stage(stage, mb, inputs, version)
            slot = _Slot(inputs, None, version, random_state)
        else:
            outputs, loss = self._run_stage(stage, mb, inputs, version)
            slot = _Slot(inputs, outputs, version, loss=loss)
        self._slots[(stage, mb)] = slot
        if loss is not None:
            self._loss = loss.detach() if self._loss is None else self._loss + loss.detach()
        elif stage == self.last_stage:
            self.outputs[mb] = tuple(t.detach() for t in outputs)
        else:
            self._activations[(stage, mb)] = tuple(t.detach() for t in outputs)

    # backward -------------------------------------------------------------------------
    def _differentiable(self, stage: int, microbatch: int, slot: _Slot) -> tuple[Tensors, Tensors]:
        """The tensors to differentiate and their incoming gradients."""
        if slot.outputs is None:
            slot.outputs, slot.loss = recompute(
                lambda: self._run_stage(stage, microbatch, slot.inputs, slot.version),
                slot.random_state,
            )
        if stage == self.last_stage:
            return (slot.loss,), (torch.ones_like(slot.loss),)
        key = (stage + 1, microbatch)
        grads = (
            self._input_grads.pop(key)
            if key in self._input_grads
            else self._output_grads.pop((stage, microbatch))
        )
        floating = [t for t in slot.outputs if t.is_floating_point()]
        pairs = [(t, g) for t, g in zip(floating, grads) if t.requires_grad]
        return tuple(t for t, _ in pairs), tuple(g for _, g in pairs)

    def _backward(self, action: Action) -> None:
        stage, mb = action.stage, action.microbatch
        slot = self._slots[(stage, mb)]
        tensors, grads = self._differentiable(stage, mb, slot)
        leaves = [t for t in slot.inputs if t.requires_grad]
        if self.schedule.split_backward:
            # input gradients only; the weight gradients follow in W on the kept graph
            input_grads = (
                torch.autograd.grad(tensors, leaves, grads, retain_graph=True, allow_unused=True)
                if leaves and tensors
                else ()
            )
            slot.differentiable, slot.output_grads = tensors, grads
        else:
            self._arm_if_last(stage, mb, slot.version)
            if tensors:
                torch.autograd.backward(tensors, grads)
            input_grads = tuple(t.grad for t in leaves)
            del self._slots[(stage, mb)]
        if stage > 0:
            floating = [t for t in slot.inputs if t.is_floating_point()]
            by_leaf = dict(zip(map(id, leaves), input_grads))
            self._input_grads[(stage, mb)] = tuple(
                by_leaf.get(id(t)) if by_leaf.get(id(t)) is not None else torch.zeros_like(t)
                for t in floating
            )

    def _weight(self, action: Action) -> None:
        slot = self._slots.pop((action.stage, action.microbatch))
        parameters = self._gradient_holders(action.stage, slot.version)
        self._arm_if_last(action.stage, action.microbatch, slot.version)
        if parameters and slot.differentiable:
            torch.autograd.backward(slot.differentiable, slot.output_grads, inputs=parameters)

    # communication --------------------------------------------------------------------
    def _send_activation(self, action: Action) -> None:
        tensors = self._activations.pop((action.stage, action.microbatch))
        self.transport.send(tensors, action.peer, ("F", action.stage))

    def _send_gradient(self, action: Action) -> None:
        grads = self._input_grads.pop((action.stage, action.microbatch))
        self.transport.send(grads, action.peer, ("B", action.stage - 1))

    @staticmethod
    def _channel(action: Action) -> tuple:
        return ("F", action.stage - 1) if action.kind is Kind.RECV_F else ("B", action.stage)

    def _post_receives(self) -> None:
        """Post upcoming receives early, in order, one outstanding per peer: the data then
        lands while this rank computes, and a receive action only waits. Messages from one
        peer are matched in order, and a first message on a channel is two (shapes, then
        data), so a second receive from the same peer could take the wrong one.

        Only on GPUs: on a CPU whose cores all compute, an early receive is served by the
        backend's I/O thread only when the scheduler preempts a compute thread, which
        delays the data by milliseconds; posted when needed, it runs at once."""
        while self._prefetch and self._next_receive < len(self._receives):
            action = self._receives[self._next_receive]
            if action.peer in self._busy_peers:
                return
            self._busy_peers.add(action.peer)
            self._posted[(action.kind, action.stage, action.microbatch)] = (
                self.transport.post_receive(action.peer, self._channel(action))
            )
            self._next_receive += 1

    def _take(self, action: Action) -> Tensors:
        key = (action.kind, action.stage, action.microbatch)
        if key not in self._posted:
            return self.transport.receive(action.peer, self._channel(action))
        tensors = self._posted.pop(key).wait()
        self._busy_peers.discard(action.peer)
        self._post_receives()
        return tensors

    def _receive_activation(self, action: Action) -> None:
        self._received[(action.stage, action.microbatch)] = self._take(action)

    def _receive_gradient(self, action: Action) -> None:
        self._output_grads[(action.stage, action.microbatch)] = self._take(action)
