"""A small convolutional network for the 8x8 digits images, shape (N, 1, 8, 8)."""

from __future__ import annotations

from torch import nn

from pipetrain.checks import positive_int

DIGIT_CLASSES = 10


def build_cnn(channels: int = 16) -> nn.Sequential:
    """Conv2d/ReLU layers, a max-pool, Flatten and a Linear head, each a separate entry.

    The spatial size goes 8x8 -> (pool) 4x4, so the head sees ``2 * channels * 16`` features.
    """
    positive_int("cnn channels", channels)
    wide = 2 * channels
    return nn.Sequential(
        nn.Conv2d(1, channels, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.Conv2d(channels, wide, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(wide, wide, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(wide * 4 * 4, DIGIT_CLASSES),
    )
