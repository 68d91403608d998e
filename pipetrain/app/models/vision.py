"""Convolutional networks for the 8x8 digits images, shape (N, 1, 8, 8): a small one, and a
VGG-style one whose weights sit in its fully connected layers and its compute in its
convolutions."""

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


def build_vgg(channels: int = 128, hidden: int = 1024) -> nn.Sequential:
    """VGG's shape at the digits' size: three 3x3 convolutions (``channels // 2``, then
    ``channels`` twice) at 8x8, a max-pool to 4x4, then two ``hidden``-wide fully connected
    layers and the classifier, each a separate entry.

    With the defaults, 93% of the 3.4M parameters are in the fully connected layers and
    82% of the multiply-adds in the convolutions: PipeDream's case where data
    parallelism all-reduces many weights that cost little compute.
    """
    positive_int("vgg channels", channels)
    positive_int("vgg hidden", hidden)
    half = max(1, channels // 2)
    return nn.Sequential(
        nn.Conv2d(1, half, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.Conv2d(half, channels, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.Conv2d(channels, channels, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(channels * 4 * 4, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, DIGIT_CLASSES),
    )
