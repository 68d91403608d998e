"""Per-layer costs of a model: the :class:`Profile` type and :func:`profile`, which measures one.

:func:`profile` needs torch and is imported on first use, so that planning from a saved
profile stays cheap to import.
"""

from typing import Any

from pipetrain.profiler.costs import FORMAT_VERSION, LayerCost, Profile, Spread, pooled

__all__ = ["FORMAT_VERSION", "LayerCost", "Profile", "Spread", "pooled", "profile"]


def __getattr__(name: str) -> Any:
    """Import :func:`profile` (and torch) only when it is asked for."""
    if name == "profile":
        from pipetrain.profiler.measure import profile

        return profile
    raise AttributeError(f"module 'pipetrain.profiler' has no attribute {name!r}")
