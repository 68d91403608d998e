"""The schedules a pipeline plays, and playing one on a rank.

:func:`prepare` turns a :class:`~pipetrain.runtime.config.PipelineConfig` into the training
schedule (with the targets' transfer when the input stage ships them) and the forward-only
schedule that evaluation runs. A :class:`StepPlayer` splits a step's data for its rank, has
the executor play a schedule on it (for a step whose rows were formed into another number
of micro-batches, the schedule built for that number, once), delivers the last stage's
outputs where asked, and turns any failure into a
:class:`~pipetrain.distributed.failure.PipelineError` naming the rank and stage where it
began.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from pipetrain.distributed.failure import explain_peer_failure, report_origin
from pipetrain.distributed.transport import PeerError, Tensors
from pipetrain.model.frontend import FrontEnd
from pipetrain.planning.partition import partition
from pipetrain.runtime.assembly import Rank
from pipetrain.runtime.config import PipelineConfig
from pipetrain.runtime.outputs import Destination, deliver
from pipetrain.runtime.rank.batch import Data, StepData
from pipetrain.runtime.rank.executor import ActionFailed, Outcome
from pipetrain.runtime.rank.update import NonFiniteError
from pipetrain.runtime.token_budget import formed
from pipetrain.schedules import Schedule, forward_only, with_targets_shipped

Outputs = torch.Tensor | tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Prepared:
    """What :func:`prepare` makes: the training and evaluation schedules, the layers per
    stage, the micro-batches of each update, and (with a token budget) what the same
    configuration prepares for another micro-batch count."""

    schedule: Schedule
    evaluation: Schedule
    balance: list[int]
    per_update: int
    microbatch_tokens: int | None = None
    with_count: Callable[[int], Prepared] | None = None


def prepare(config: PipelineConfig, world: int, front: FrontEnd, has_optimizer: bool) -> Prepared:
    """The schedules ``config`` runs on ``world`` ranks for the model ``front`` holds."""
    layers = len(front.layers)
    if front.split and config.balance is None:
        stages = config.build(world, None, has_optimizer).stages
        if stages != layers:
            raise ValueError(
                f"split_points make {layers} stages but the schedule on {world} "
                f"ranks runs {stages}; give {stages - 1} split points"
            )
    built = config.build(world, layers, has_optimizer)
    # a captured model's default cut balances its segments' parameters
    sizes = front.parameter_sizes() if config.balance is None else None
    balance = partition(sizes, built.stages) if sizes else config.balance_for(layers, built)
    per_update = config.per_update(built)
    if config.targets_on_first_stage:
        built = replace(built, ranks=with_targets_shipped(built.ranks, built.stage_ranks))
    # evaluation runs the forwards alone on the newest weights, as a schedule of its own
    evaluation = replace(
        built, ranks=forward_only(built.ranks, built.stage_ranks), asynchronous=False
    )
    with_count = None
    if config.microbatch_tokens is not None:
        fixed = replace(config, microbatch_tokens=None, balance=balance)

        def with_count(count: int) -> Prepared:
            return prepare(replace(fixed, microbatches=count), world, front, has_optimizer)

    tokens = config.microbatch_tokens
    return Prepared(built, evaluation, balance, per_update, tokens, with_count)


class StepPlayer:
    """Plays schedules on one rank's parts (``parts``, rank ``rank`` of ``group``)."""

    def __init__(
        self,
        parts: Rank,
        rank: int,
        group: dist.ProcessGroup | None,
        prepared: Prepared,
        ships_targets: bool,
    ) -> None:
        """Play ``prepared``'s schedules; ``ships_targets`` when the input stage's ranks
        are given the targets."""
        self.parts, self.rank, self.group = parts, rank, group
        self.prepared, self.ships_targets = prepared, ships_targets
        self.device = parts.transport.device
        self._by_count = {prepared.schedule.microbatches: prepared}

    def for_count(self, count: int) -> Prepared:
        """The schedules for ``count`` micro-batches a step, built on first use and kept."""
        if count not in self._by_count:
            assert self.prepared.with_count is not None, "only a token budget changes counts"
            self._by_count[count] = self.prepared.with_count(count)
        return self._by_count[count]

    def runnable(self, count: int) -> int:
        """The smallest micro-batch count from ``count`` up that the schedule runs."""
        world = len(self.prepared.schedule.ranks)
        for tried in range(count, count + 2 * world):
            try:
                return self.for_count(tried).schedule.microbatches
            except ValueError:  # a family that needs a multiple of the ranks, say
                continue
        return self.for_count(count).schedule.microbatches  # raises, naming the need

    def data(self, inputs: Data | None, targets: Data | None, training: bool) -> StepData:
        """The step's data this rank reads, split into micro-batches (rows given as
        :class:`~pipetrain.runtime.token_budget.Sequences` formed into them first)."""
        prepared = self.prepared
        if training:
            inputs, targets, count = formed(
                inputs,
                targets,
                budget=prepared.microbatch_tokens,
                count=prepared.schedule.microbatches,
                chooses=self.rank == prepared.schedule.stage_ranks[0][0],
                transport=self.parts.transport,
                runnable=self.runnable,
            )
            prepared = self.for_count(count)
        return StepData.for_rank(
            prepared.schedule,
            self.rank,
            inputs,
            targets if training else None,
            training=training,
            ships_targets=self.ships_targets,
            per_update=prepared.per_update,
            device=self.device,
        )

    def play(
        self,
        schedule: Schedule,
        data: StepData,
        update: bool = True,
        to: Destination | None = None,
    ) -> tuple[Outcome, Outputs | None]:
        """Play ``schedule`` on ``data``; with ``to``, also deliver the last stage's outputs
        there (see :func:`~pipetrain.runtime.outputs.deliver`)."""
        parts = self.parts
        if data.microbatches != schedule.microbatches:  # a step formed by a token budget
            schedule = self.for_count(data.microbatches).schedule
        if parts.recorder.enabled:
            dist.barrier(group=self.group)
            parts.recorder.reset()
        stage = min(parts.stages)
        outputs: Tensors | None = None
        try:
            outcome = parts.executor.run(schedule, data, update)
            parts.transport.flush()
            if to is not None:
                outputs = deliver(
                    parts.transport,
                    self.rank,
                    schedule.num_ranks,  # of the schedule: tensor-parallel mirrors share one
                    schedule.stage_ranks,
                    schedule.microbatches,
                    outcome.outputs,
                    to,
                )
        except NonFiniteError as error:
            if not schedule.asynchronous:
                raise  # every rank refused the same update: nothing failed
            raise report_origin(
                self.rank, stage, f"rank {self.rank} (stage {stage}) failed: {error}"
            ) from error
        except ActionFailed as error:
            raise report_origin(self.rank, error.stage, str(error)) from error
        except PeerError as error:
            raise explain_peer_failure(self.rank, stage, str(error)) from error
        except Exception as error:
            raise report_origin(
                self.rank,
                stage,
                f"rank {self.rank} (stage {stage}) failed: {type(error).__name__}: {error}",
            ) from error
        if outputs is None:
            return outcome, None
        return outcome, outputs[0] if len(outputs) == 1 else outputs
