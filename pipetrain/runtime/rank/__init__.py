"""One rank's machinery: what plays a schedule's actions against the stages a rank holds.

- :mod:`~pipetrain.runtime.rank.executor`: plays a rank's actions, dispatching each one;
- :mod:`~pipetrain.runtime.rank.stage`: one stage's passes and the tensors between them;
- :mod:`~pipetrain.runtime.rank.weights`: weight versions and the optimizer's stepping;
- :mod:`~pipetrain.runtime.rank.cycle`: the update cycle, its one owner: accumulation,
  loss normalization, the step's loss, the update and its counters;
- :mod:`~pipetrain.runtime.rank.update`: what an update does: global norm, clipping, the
  finiteness check, the learning-rate scheduler; :mod:`~pipetrain.runtime.rank.update_config`
  its settings as a user gives them;
- :mod:`~pipetrain.runtime.rank.normalize`: the division of ``(loss_sum, count)`` losses'
  gradients by the step's count, for the cycle;
- :mod:`~pipetrain.runtime.rank.precision`: autocast and the fp16 loss scale;
- :mod:`~pipetrain.runtime.rank.batch`: a step's data split into micro-batches;
- :mod:`~pipetrain.runtime.rank.losses`: what a loss function may return, and
  :func:`causal_lm_loss`;
- :mod:`~pipetrain.runtime.rank.reduce`: replicated stages' gradient all-reduce;
  :mod:`~pipetrain.runtime.rank.shared`: parameters several stages share;
- :mod:`~pipetrain.runtime.rank.recompute`: re-materialization;
  :mod:`~pipetrain.runtime.rank.batchnorm`: batch normalization deferred to the step;
- :mod:`~pipetrain.runtime.rank.recorder`: measured timelines.
"""
