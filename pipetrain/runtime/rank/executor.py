"""Play one rank's actions: each is dispatched to a stage, the transport or the update
cycle.

The executor knows nothing about how the schedule was chosen and keeps no tensors of its
own beyond the gathered outputs: stages hold what passes between their forwards and
backwards, the update cycle (:mod:`~pipetrain.runtime.rank.cycle`) the step's loss and
everything about updates.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from pipetrain.distributed.inbox import Inbox
from pipetrain.distributed.transport import PeerError, Tensors, Transport
from pipetrain.runtime.rank.batch import StepData
from pipetrain.runtime.rank.cycle import UpdateCycle
from pipetrain.runtime.rank.recorder import Recorder
from pipetrain.runtime.rank.stage import Stage
from pipetrain.runtime.rank.update import NonFiniteError
from pipetrain.schedules import Action, Kind, Schedule
from pipetrain.schedules.lower import weight_pass_of
from pipetrain.schedules.messages import channel, rank_of


def whole_backwards(lane: tuple[Action, ...]) -> frozenset[tuple[int, int]]:
    """The ``(stage, micro-batch)`` pairs whose W comes right after their B in ``lane``:
    nothing runs between the two, so they run as one backward, cheaper than its two
    passes."""
    return frozenset(
        (action.stage, action.microbatch)
        for action, following in itertools.pairwise(lane)
        if weight_pass_of(action, following) and action.microbatch is not None
    )


class ActionFailed(RuntimeError):
    """An action raised on this rank; names the rank, stage and action."""

    def __init__(self, rank: int, action: Action, error: BaseException) -> None:
        """Wrap ``error`` raised while running ``action`` on ``rank``."""
        super().__init__(
            f"rank {rank} (stage {action.stage}) failed at {action}: "
            f"{type(error).__name__}: {error}"
        )
        self.rank, self.stage, self.action = rank, action.stage, action


@dataclass
class Outcome:
    """What a run leaves: the step's loss summed over every rank (after ``LOSS``; ``None``
    without one) and the last stage's outputs gathered here, by micro-batch."""

    loss: torch.Tensor | None = None
    outputs: dict[int, Tensors] = field(default_factory=dict)


class Executor:
    """Runs this rank's lane of a schedule against the stages it holds."""

    def __init__(
        self,
        rank: int,
        stages: Mapping[int, Stage],
        transport: Transport,
        cycle: UpdateCycle,
        recorder: Recorder,
    ) -> None:
        """Dispatch to ``stages`` (by stage index), ``transport`` and ``cycle``, which owns
        the losses and updates."""
        self.rank, self.stages, self.transport = rank, dict(stages), transport
        self.cycle, self.recorder = cycle, recorder
        self._whole_of: tuple[Schedule | None, frozenset[tuple[int, int]]] = (None, frozenset())
        self._handlers: dict[Kind, Callable[[Action], None]] = {
            Kind.FORWARD: self._forward,
            Kind.BACKWARD: self._backward,
            Kind.WEIGHT: self._weight,
            Kind.SEND_F: self._send_outputs,
            Kind.SEND_B: self._send_gradient,
            Kind.SEND_T: self._send_targets,
            Kind.SEND_O: self._send_outputs,
            Kind.RECV_F: self._receive_activation,
            Kind.RECV_B: self._receive_gradient,
            Kind.RECV_T: self._receive_targets,
            Kind.RECV_O: self._receive_output,
            Kind.ALLREDUCE: lambda action: cycle.on_allreduce(action.stage),
            Kind.GATHER: lambda action: cycle.on_gather(action.stage),
            Kind.STEP: lambda action: cycle.on_step(action.stage),
            Kind.LOAD: lambda action: cycle.on_load(action.stage),
            Kind.OFFLOAD: lambda action: cycle.on_offload(action.stage),
            Kind.LOSS: self._loss,
            # an overlapped pair's forward and backward follow as actions of their own, run
            # one after the other on this rank's one stream of work
            Kind.OVERLAP: lambda action: None,
        }

    def run(self, schedule: Schedule, data: StepData, update: bool = True) -> Outcome:
        """Play this rank's actions of ``schedule`` on ``data``; the stages are left empty
        whether it ends or raises. Without ``update`` (synchronous schedules only) the
        gradients accumulate: ``STEP`` applies nothing and replicas do not all-reduce (they
        will, once, at the update)."""
        lane = schedule.ranks[self.rank]
        self._schedule, self._data, self._outcome = schedule, data, Outcome()
        if self._whole_of[0] is not schedule:  # a step's lane is read once per schedule
            whole = whole_backwards(lane) if schedule.split_backward else frozenset()
            self._whole_of = (schedule, whole)
        self._whole = self._whole_of[1]
        self.cycle.begin(schedule, lane, update)
        self._inbox = Inbox(self.transport, lane)
        recorder = self.recorder
        try:
            for action in lane:
                start = recorder.now() if recorder.enabled else 0.0
                try:
                    self._handlers[action.kind](action)
                except (ActionFailed, PeerError, NonFiniteError):
                    raise
                except Exception as error:
                    raise ActionFailed(self.rank, action, error) from error
                if recorder.enabled:
                    recorder.add(
                        action.kind.value, action.stage, action.microbatch, start, recorder.now()
                    )
            last = self.stages.get(schedule.stages - 1)
            if last is not None:
                self._outcome.outputs.update(last.remaining_outputs())
            return self._outcome
        finally:
            for stage in self.stages.values():
                stage.clear()
            self.cycle.settle()

    def _local(self, stage: int, microbatch: int) -> Stage | None:
        """Stage ``stage`` if this rank runs its ``microbatch``, else ``None``."""
        if stage not in self.stages:
            return None
        if rank_of(self._schedule.stage_ranks, stage, microbatch) != self.rank:
            return None
        return self.stages[stage]

    @staticmethod
    def _microbatch(action: Action) -> int:
        assert action.microbatch is not None  # the validator requires one on these kinds
        return action.microbatch

    @staticmethod
    def _peer(action: Action) -> int:
        assert action.peer is not None  # every lowered transfer names its peer
        return action.peer

    # compute --------------------------------------------------------------------------
    def _forward(self, action: Action) -> None:
        self.transport.yield_to_sends()
        stage, mb = self.stages[action.stage], self._microbatch(action)
        if action.stage == 0:
            if self._data.inputs is None:
                raise ValueError(f"rank {self.rank} runs the first stage but has no inputs")
            stage.give_inputs(mb, self._data.inputs[mb])
        target = self._data.loss_target(mb) if stage.last else None
        version = self.cycle.version(action.stage, action.version)
        loss = stage.forward(mb, version, target, self._data.keep_outputs)
        if loss is not None:
            self.cycle.add_loss(loss)
        following = None if stage.last else self._local(action.stage + 1, mb)
        if following is not None:
            following.give_inputs(mb, stage.take_outputs(mb))

    def _arm(self, action: Action) -> None:
        """Before a gradient pass: it may complete a replicated stage's update."""
        self.cycle.before_gradient_pass(self.stages[action.stage], self._microbatch(action))

    def _backward(self, action: Action) -> None:
        self.transport.yield_to_sends()
        stage, mb = self.stages[action.stage], self._microbatch(action)
        whole = (action.stage, mb) in self._whole
        if whole or not stage.split_backward:
            self._arm(action)
        stage.backward(mb, whole=whole)
        previous = self._local(action.stage - 1, mb) if action.stage > 0 else None
        if previous is not None:
            previous.give_output_grads(mb, stage.take_input_grads(mb))

    def _weight(self, action: Action) -> None:
        if (action.stage, self._microbatch(action)) in self._whole:
            return  # computed with its backward, which came right before it
        self.transport.yield_to_sends()
        self._arm(action)
        self.stages[action.stage].weight(self._microbatch(action))

    def _loss(self, action: Action) -> None:
        self._outcome.loss = self.cycle.on_loss()

    # transfers ------------------------------------------------------------------------
    def _send_outputs(self, action: Action) -> None:
        tensors = self.stages[action.stage].take_outputs(self._microbatch(action))
        self.transport.send(tensors, self._peer(action), channel(action))

    def _send_gradient(self, action: Action) -> None:
        grads = self.stages[action.stage].take_input_grads(self._microbatch(action))
        self.transport.send(grads, self._peer(action), channel(action))

    def _send_targets(self, action: Action) -> None:
        if self._data.shipped is None:
            raise ValueError(f"rank {self.rank} ships the targets but was given none")
        self.transport.send(self._data.shipped, self._peer(action), channel(action))

    def _receive_activation(self, action: Action) -> None:
        tensors = self._inbox.take(action)
        self.stages[action.stage].give_inputs(self._microbatch(action), tensors)

    def _receive_gradient(self, action: Action) -> None:
        tensors = self._inbox.take(action)
        self.stages[action.stage].give_output_grads(self._microbatch(action), tensors)

    def _receive_targets(self, action: Action) -> None:
        self._data.receive_targets(self._inbox.take(action))

    def _receive_output(self, action: Action) -> None:
        self._outcome.outputs[self._microbatch(action)] = self._inbox.take(action)
