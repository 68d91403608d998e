"""Play one rank's actions: each is dispatched to a stage, the transport, the weights or a
gradient reducer.

The executor knows nothing about how the schedule was chosen and keeps no tensors of its
own beyond the step's summed loss and gathered outputs: stages hold what passes between
their forwards and backwards, the weights object holds versions and the optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from pipetrain.runtime.batch import StepData
from pipetrain.runtime.inbox import Inbox
from pipetrain.runtime.normalize import Normalizer, check_kinds
from pipetrain.runtime.recorder import Recorder
from pipetrain.runtime.reduce import GradientReducer, completing_passes
from pipetrain.runtime.stage import Stage
from pipetrain.runtime.transport import PeerError, Tensors, Transport
from pipetrain.runtime.update import NonFiniteError
from pipetrain.runtime.weights import Weights
from pipetrain.schedules import Action, Kind, Schedule
from pipetrain.schedules.messages import channel, rank_of


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
        weights: Weights,
        recorder: Recorder,
        reducers: Mapping[int, GradientReducer] | None = None,
    ) -> None:
        """Dispatch to ``stages`` (by stage index), ``transport``, ``weights`` and
        ``reducers``, which all-reduce the gradients of this rank's replicated stages."""
        self.rank, self.stages, self.transport = rank, dict(stages), transport
        self.weights, self.recorder = weights, recorder
        self.reducers = dict(reducers or {})
        holders = {stage: weights.holders(stage, None) for stage in self.stages}
        # divides the gradients of (loss_sum, count) losses by the step's count
        self.normalizer = Normalizer(holders, self.reducers, transport.all_reduce, transport.device)
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
            Kind.ALLREDUCE: self._allreduce,
            Kind.STEP: self._step,
            Kind.LOSS: self._all_reduce_loss,
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
        self._schedule, self._data = schedule, data
        device = self.transport.device
        self._outcome, self._loss = Outcome(), torch.zeros((), device=device)
        self._count, self._pairs = torch.zeros((), dtype=torch.float64, device=device), 0
        # the step's count is learnt after this rank's last backward: at its last STEP
        self._steps_left = sum(a.kind is Kind.STEP for a in lane)
        self._normalized = False
        self._reduced_loss: torch.Tensor | None = None  # by the update, when it sums them
        self.weights.begin(lane, update)
        reduced = self.reducers if update else {}
        self._arming = completing_passes(lane, reduced, schedule.split_backward)
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
        stage, mb = self.stages[action.stage], self._microbatch(action)
        if action.stage == 0:
            if self._data.inputs is None:
                raise ValueError(f"rank {self.rank} runs the first stage but has no inputs")
            stage.give_inputs(mb, self._data.inputs[mb])
        target = self._data.loss_target(mb) if stage.last else None
        version = self.weights.version(action.stage, action.version)
        loss = stage.forward(mb, version, target, self._data.keep_outputs)
        if loss is not None:
            self._loss += loss[0]
            if loss[1] is not None:
                if self._schedule.asynchronous:
                    raise ValueError(
                        f"{self._schedule.name} updates before a step's count is known, so "
                        "its loss function must return a scalar mean, not (loss_sum, count); "
                        "use a synchronous schedule (gpipe, 1f1b, interleaved, zb-h1) for "
                        "token-level normalization"
                    )
                self._count += loss[1].double()
                self._pairs += 1
        following = None if stage.last else self._local(action.stage + 1, mb)
        if following is not None:
            following.give_inputs(mb, stage.take_outputs(mb))

    def _arm(self, action: Action) -> None:
        """Before an update's last gradient pass, let it start the all-reduce of each bucket
        it completes."""
        key = (action.stage, self._microbatch(action))
        if key in self._arming:
            self.reducers[action.stage].arm(self.stages[action.stage].gradient_holders(key[1]))

    def _backward(self, action: Action) -> None:
        stage, mb = self.stages[action.stage], self._microbatch(action)
        if not stage.split_backward:
            self._arm(action)
        stage.backward(mb)
        previous = self._local(action.stage - 1, mb) if action.stage > 0 else None
        if previous is not None:
            previous.give_output_grads(mb, stage.take_input_grads(mb))

    def _weight(self, action: Action) -> None:
        self._arm(action)
        self.stages[action.stage].weight(self._microbatch(action))

    # updates --------------------------------------------------------------------------
    def _allreduce(self, action: Action) -> None:
        if not self.weights.updating:
            return
        self.reducers[action.stage].finish(self.weights.holders(action.stage, None))
        self.weights.collect(action.stage)

    def _normalize(self) -> None:
        """Divide the step's gradients by its count, once (see :mod:`.normalize`)."""
        if not self._normalized and not self._schedule.asynchronous:
            self._normalized = True
            self.normalizer.finish(
                self._count, self._pairs, self._schedule.microbatches, self.weights.updating
            )

    def _loss_stats(self) -> torch.Tensor:
        """This rank's share of the step's loss, its target count and its pair losses."""
        return torch.stack([self._loss.double(), self._count, self._count.new_tensor(self._pairs)])

    def _step(self, action: Action) -> None:
        self._steps_left -= 1
        if self._steps_left > 0:
            self.weights.step(action.stage, self._loss)
            return
        # a synchronous update sums the loss statistics with its gradient norm, so LOSS
        # takes them from there instead of all-reducing again; where it can, the update
        # also divides by the step's count that they carry (one all-reduce, not two)
        if self._update_normalizes():
            self._normalized = True
            self.weights.step(action.stage, self._loss_stats(), self._normalize_summed)
        else:
            self._normalize()
            self.weights.step(action.stage, self._loss_stats())
        if self.weights.updating and not self._schedule.asynchronous:
            self._reduced_loss = self.weights.updater.take_reduced_loss()

    def _update_normalizes(self) -> bool:
        """Whether this rank's update, now, can divide the step's gradients by its count:
        a synchronous update, with no gradients of earlier steps put aside (their norm is
        known only once they are added back after the division)."""
        return (
            not self._normalized
            and not self._schedule.asynchronous
            and self.weights.updating
            and self.weights.updater.active
            and self.normalizer.normalizing is not False
            and not self.normalizer.holds_aside
        )

    def _normalize_summed(self, reduced: torch.Tensor) -> float:
        """Divide by the step's count in the update's summed loss statistics."""
        return self.normalizer.divide(
            reduced[1], round(float(reduced[2])), self._schedule.microbatches, True
        )

    def _all_reduce_loss(self, action: Action) -> None:
        self._normalize()
        stats = self._reduced_loss
        if stats is None:
            stats = self._loss_stats()
            self.transport.all_reduce(stats)
        pairs = round(float(stats[2]))
        if pairs:
            if not self.normalizer.normalizing:
                check_kinds(pairs, self._schedule.microbatches, False)
            stats[0] /= stats[1]
        self._outcome.loss = stats[0].float()

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
