"""Per-layer costs of a model: the :class:`Profile` type and :func:`profile`, which measures one."""

from pipetrain.profile.costs import FORMAT_VERSION, LayerCost, Profile
from pipetrain.profile.measure import profile

__all__ = ["FORMAT_VERSION", "LayerCost", "Profile", "profile"]
