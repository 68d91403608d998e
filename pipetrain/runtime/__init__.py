"""Run schedules on real processes: transport, stage execution, launching, failures."""

from pipetrain.runtime.failure import PipelineError
from pipetrain.runtime.launch import LaunchError, launch
from pipetrain.runtime.pipeline import Pipeline

__all__ = ["LaunchError", "Pipeline", "PipelineError", "launch"]
