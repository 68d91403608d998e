"""pipetrain: pipeline-parallel training for PyTorch.

Profile a model, plan how to split it over workers, simulate the plan, and run it on
torch.distributed with GPipe, 1F1B, interleaved, zero-bubble or PipeDream schedules.
"""

from typing import Any

from pipetrain import schedules
from pipetrain.planning import Level, Plan, PlanStage, Topology, plan
from pipetrain.profiler import LayerCost, Profile
from pipetrain.simulation import Costs, simulate
from pipetrain.timeline import Event, Timeline, plot_timelines

__version__ = "0.1.0"

__all__ = [
    "Costs",
    "Event",
    "LaunchError",
    "LayerCost",
    "Level",
    "ModelSource",
    "Pipeline",
    "PipelineConfig",
    "PipelineError",
    "Plan",
    "PlanStage",
    "Profile",
    "RuntimeConfig",
    "Timeline",
    "Topology",
    "UpdateConfig",
    "causal_lm_loss",
    "launch",
    "plan",
    "plot_timelines",
    "profile",
    "schedules",
    "simulate",
]

_RUNTIME = (
    "ModelSource",
    "Pipeline",
    "PipelineConfig",
    "PipelineError",
    "LaunchError",
    "RuntimeConfig",
    "UpdateConfig",
    "causal_lm_loss",
    "launch",
)


def __getattr__(name: str) -> Any:
    """Import the torch-backed parts (runtime, profiler) on first use, so the pure parts
    stay cheap to import."""
    if name in _RUNTIME:
        from pipetrain import runtime

        return getattr(runtime, name)
    if name == "profile":
        from pipetrain.profiler.measure import profile

        return profile
    raise AttributeError(f"module 'pipetrain' has no attribute {name!r}")
