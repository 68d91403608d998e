"""Multi-layer perceptrons for the 8x8 digits data (64 features, 10 classes)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from pipetrain.checks import positive_int

DIGIT_FEATURES = 64
DIGIT_CLASSES = 10


def build_mlp(hidden: int = 128, hidden_layers: int = 2) -> nn.Sequential:
    """An MLP whose Linear and ReLU layers are separate entries: Linear, ReLU, ..., Linear.

    With the defaults it has 5 entries (2 hidden layers of width ``hidden``).
    """
    positive_int("mlp hidden", hidden)
    positive_int("mlp hidden_layers", hidden_layers)
    entries: list[nn.Module] = []
    width = DIGIT_FEATURES
    for _ in range(hidden_layers):
        entries += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    entries.append(nn.Linear(width, DIGIT_CLASSES))
    return nn.Sequential(*entries)


# Narrow layers first, then wide ones: an equal split by layer count puts almost all the
# compute on the second half, so balancing by profiled time matters.
UNEVEN_WIDTHS = (64, 64, 64, 1024, 1024, 1024, 256)


def build_uneven_mlp(widths: Sequence[int] = UNEVEN_WIDTHS) -> nn.Sequential:
    """An MLP with deliberately uneven layer costs, for planner benchmarks.

    Each entry but the last is one ``Linear + ReLU`` block, ``widths[i-1] -> widths[i]``
    (the first from the 64 input features); the last entry is the Linear head to 10 classes.
    The defaults give 8 entries whose first half costs a small fraction of the second.
    Hidden layers use He initialisation so the signal survives the depth and it trains quickly.
    """
    if len(widths) == 0 or any(width < 1 for width in widths):
        raise ValueError(
            f"uneven-mlp widths {tuple(widths)} must be a non-empty list of positive ints"
        )
    entries: list[nn.Module] = []
    width = DIGIT_FEATURES
    for next_width in widths:
        linear = nn.Linear(width, next_width)
        nn.init.kaiming_normal_(linear.weight, nonlinearity="relu")
        nn.init.zeros_(linear.bias)
        entries.append(nn.Sequential(linear, nn.ReLU()))
        width = next_width
    entries.append(nn.Linear(width, DIGIT_CLASSES))
    return nn.Sequential(*entries)
