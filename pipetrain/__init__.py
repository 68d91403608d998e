"""pipetrain: pipeline-parallel training for PyTorch.

Profile a model, plan how to split it over workers, simulate the plan, and run it on
torch.distributed with GPipe, 1F1B, interleaved, zero-bubble or PipeDream schedules.
"""

from pipetrain import schedules
from pipetrain.simulate import Costs, simulate
from pipetrain.trace import Event, Timeline, plot_timelines

__version__ = "0.1.0"

__all__ = [
    "Costs",
    "Event",
    "LaunchError",
    "Pipeline",
    "PipelineError",
    "Timeline",
    "launch",
    "plot_timelines",
    "schedules",
    "simulate",
]


def __getattr__(name: str):
    # the runtime imports torch; keep `import pipetrain` cheap for the pure parts
    if name in ("Pipeline", "PipelineError", "LaunchError", "launch"):
        from pipetrain import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'pipetrain' has no attribute {name!r}")
