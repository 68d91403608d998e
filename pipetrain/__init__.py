"""pipetrain: pipeline-parallel training for PyTorch.

Profile a model, plan how to split it over workers, simulate the plan, and run it on
torch.distributed with any of thirteen schedules: ``gpipe``, ``1f1b``, ``interleaved``,
``zb-h1``, ``pipedream``, ``2bw``, ``looped-bfs``, ``interleaved-zb``, ``zb-v``, ``v-half``,
``v-min``, ``dualpipev`` and ``roundpipe``, whose workers load each stage's weights from a
host store (:func:`pipetrain.schedules.names` lists every registered one).

``import pipetrain`` loads no torch: the torch-backed parts (:class:`Pipeline`,
:func:`profile`, :func:`launch`, and the packages :mod:`pipetrain.runtime`,
:mod:`pipetrain.checkpoint`, :mod:`pipetrain.model`, :mod:`pipetrain.distributed`) are
imported on first use, so ``pipetrain.checkpoint.latest(...)`` works after ``import pipetrain``.
"""

import importlib
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

SUBPACKAGES = (
    "allocation",
    "checkpoint",
    "checks",
    "data",
    "distributed",
    "jsonfile",
    "model",
    "planning",
    "profiler",
    "runtime",
    "schedules",
    "simulation",
    "timeline",
    "units",
)
"""Every package and module of the library, each reachable as ``pipetrain.NAME`` (the
command's :mod:`pipetrain.app`, which the library never imports, is imported by name)."""


def __getattr__(name: str) -> Any:
    """Import the torch-backed parts (runtime, profiler, the packages above) on first use,
    so the pure parts stay cheap to import."""
    if name in _RUNTIME:
        from pipetrain import runtime

        return getattr(runtime, name)
    if name == "profile":
        from pipetrain.profiler.measure import profile

        return profile
    if name in SUBPACKAGES:
        return importlib.import_module(f"pipetrain.{name}")
    raise AttributeError(f"module 'pipetrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names, the lazily imported ones included."""
    return sorted(set(globals()) | set(__all__) | set(SUBPACKAGES))
