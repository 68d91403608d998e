"""Model front-ends: a model as an ordered list of layers, and stage modules that run a
range of them under the full model's parameter names."""

from pipetrain.model.layers import StageModule, check_balance, stage_bounds, to_layers

__all__ = ["StageModule", "check_balance", "stage_bounds", "to_layers"]
