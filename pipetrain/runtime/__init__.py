"""Run schedules on real processes: the :class:`Pipeline` facade and its settings.

- :mod:`~pipetrain.runtime.pipeline`: :class:`Pipeline`, the facade;
- :mod:`~pipetrain.runtime.config`: the settings objects: :class:`PipelineConfig` (the
  schedule and its placement), :class:`RuntimeConfig` (device, group, timeout, recording),
  :class:`ModelSource` (example inputs, initialization, initial weights);
  :class:`UpdateConfig` (what an update does) lives beside the update it configures;
- :mod:`~pipetrain.runtime.agreement`: every rank checks that it was given the same;
- :mod:`~pipetrain.runtime.steps`: the schedules a pipeline plays, and playing one;
- :mod:`~pipetrain.runtime.assembly`: builds and wires a rank, on a given transport;
- :mod:`~pipetrain.runtime.model_io` and :mod:`~pipetrain.runtime.outputs`: a step's data
  as the model takes and returns it, and the outputs delivered where asked;
- :mod:`~pipetrain.runtime.rank`: one rank's machinery (executor, stages, weights, the
  update cycle).

Processes and bytes are :mod:`pipetrain.distributed`'s; :func:`launch`,
:class:`PipelineError` and :func:`keep_freed_memory` are re-exported here.
"""

from pipetrain.distributed.failure import PipelineError
from pipetrain.distributed.heap import keep_freed_memory
from pipetrain.distributed.launch import LaunchError, launch
from pipetrain.runtime.config import ModelSource, PipelineConfig, RuntimeConfig
from pipetrain.runtime.pipeline import Pipeline
from pipetrain.runtime.rank.batch import MicroBatches
from pipetrain.runtime.rank.losses import causal_lm_loss
from pipetrain.runtime.rank.update import NonFiniteError
from pipetrain.runtime.rank.update_config import UpdateConfig
from pipetrain.runtime.token_budget import Sequences

__all__ = [
    "LaunchError",
    "MicroBatches",
    "ModelSource",
    "NonFiniteError",
    "Pipeline",
    "PipelineConfig",
    "PipelineError",
    "RuntimeConfig",
    "Sequences",
    "UpdateConfig",
    "causal_lm_loss",
    "keep_freed_memory",
    "launch",
]
