"""Run schedules on real processes.

- :mod:`~pipetrain.runtime.config`: :class:`PipelineConfig`, what a run is;
- :mod:`~pipetrain.runtime.pipeline`: :class:`Pipeline`, the facade;
- :mod:`~pipetrain.runtime.assembly`: builds and wires a rank;
- :mod:`~pipetrain.runtime.steps`: the schedules a pipeline plays, and playing one;
- :mod:`~pipetrain.runtime.precision`: autocast and the fp16 loss scale;
- :mod:`~pipetrain.runtime.executor`: plays a rank's actions, dispatching each one;
- :mod:`~pipetrain.runtime.stage`: one stage's passes and the tensors between them;
- :mod:`~pipetrain.runtime.weights`: weight versions and optimizer updates;
- :mod:`~pipetrain.runtime.update`: what an update does: global norm, clipping, the
  finiteness check, the learning-rate scheduler;
- :mod:`~pipetrain.runtime.batch`: a step's data split into micro-batches;
- :mod:`~pipetrain.runtime.losses`: what a loss function may return, and
  :func:`causal_lm_loss`; :mod:`~pipetrain.runtime.normalize` divides the gradients of a
  ``(loss_sum, count)`` loss by the step's count;
- :mod:`~pipetrain.runtime.outputs`: a step's last-stage outputs, delivered where asked;
- :mod:`~pipetrain.runtime.reduce`: replicated stages' gradient all-reduce;
- :mod:`~pipetrain.runtime.recompute`: re-materialization;
- :mod:`~pipetrain.runtime.transport`: the transport interface; :mod:`~pipetrain.runtime.framing`
  its message protocol, :mod:`~pipetrain.runtime.torch_transport` over torch.distributed,
  :mod:`~pipetrain.runtime.loopback` between threads; :mod:`~pipetrain.runtime.inbox`
  receives ahead of need;
- :mod:`~pipetrain.runtime.recorder`, :mod:`~pipetrain.runtime.failure`,
  :mod:`~pipetrain.runtime.launch`: measured timelines, failures, local workers;
  :mod:`~pipetrain.runtime.io_threads` and :mod:`~pipetrain.runtime.heap`: gloo's threads
  and the allocator, tuned for a worker process (:func:`keep_freed_memory`).
"""

from pipetrain.runtime.config import PipelineConfig
from pipetrain.runtime.failure import PipelineError
from pipetrain.runtime.heap import keep_freed_memory
from pipetrain.runtime.launch import LaunchError, launch
from pipetrain.runtime.losses import causal_lm_loss
from pipetrain.runtime.pipeline import Pipeline
from pipetrain.runtime.update import NonFiniteError

__all__ = [
    "LaunchError",
    "NonFiniteError",
    "Pipeline",
    "PipelineConfig",
    "PipelineError",
    "causal_lm_loss",
    "keep_freed_memory",
    "launch",
]
