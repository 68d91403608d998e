"""Processes and bytes: launching workers, moving tensors between them, liveness and the
first failure. Nothing here knows of stages, weights or losses.

- :mod:`~pipetrain.distributed.transport`: the transport interface;
  :mod:`~pipetrain.distributed.framing` its message protocol,
  :mod:`~pipetrain.distributed.torch_transport` over torch.distributed,
  :mod:`~pipetrain.distributed.loopback` between threads;
  :mod:`~pipetrain.distributed.inbox` receives ahead of need;
- :mod:`~pipetrain.distributed.heartbeat` and :mod:`~pipetrain.distributed.failure`:
  liveness and the first failure, named by rank and stage;
- :mod:`~pipetrain.distributed.launch`: local worker processes;
- :mod:`~pipetrain.distributed.io_threads` and :mod:`~pipetrain.distributed.heap`: gloo's
  threads and the allocator, tuned for a worker process.
"""
