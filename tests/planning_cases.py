"""Profiles shaped like well-known models, for the planner tests.

Magnitudes follow PipeDream's setting (V100 GPUs, fp32): VGG-16 at 64 images per
micro-batch takes about 0.34 s forward+backward (PipeDream's committed VGG-16 profile:
672.5 ms at 128); its 13 convolutions hold ~98.5% of the compute and ~11% of the 138M
weights, its 3 fully connected layers ~1.5% and ~89%.
"""

from __future__ import annotations

import numpy as np

from pipetrain.profiler import LayerCost, Profile

VGG16_CONVOLUTIONS = 13
_FLOAT = 4


def vgg16_profile(microbatch_size: int = 64) -> Profile:
    """VGG-16 on 224×224 images: 13 convolutions (pooling folded in), then 3 linear layers."""
    # (output channels, input channels, output side, pooled after)
    convolutions = [
        (64, 3, 224, False), (64, 64, 224, True), (128, 64, 112, False), (128, 128, 112, True),
        (256, 128, 56, False), (256, 256, 56, False), (256, 256, 56, True), (512, 256, 28, False),
        (512, 512, 28, False), (512, 512, 28, True), (512, 512, 14, False), (512, 512, 14, False),
        (512, 512, 14, True),
    ]  # fmt: skip
    linears = [(25088, 4096), (4096, 4096), (4096, 1000)]
    step_s = 0.34 * microbatch_size / 64
    conv_flops = [2 * out * inp * 9 * side * side for out, inp, side, _ in convolutions]
    linear_flops = [2 * inp * out for inp, out in linears]
    layers = []
    for (out, inp, side, pooled), flops in zip(convolutions, conv_flops):
        compute = 0.985 * step_s * flops / sum(conv_flops)
        outputs = out * side * side // (4 if pooled else 1)
        layers.append(
            _layer(compute, outputs * microbatch_size, out * inp * 9 + out, f"conv{len(layers)}")
        )
    for (inp, out), flops in zip(linears, linear_flops):
        compute = 0.015 * step_s * flops / sum(linear_flops)
        layers.append(_layer(compute, out * microbatch_size, inp * out + out, f"fc{len(layers)}"))
    return Profile(
        layers,
        microbatch_size=microbatch_size,
        input_bytes=_FLOAT * 3 * 224 * 224 * microbatch_size,
    )


def resnet_like_profile(layers: int = 50, microbatch_size: int = 64, seed: int = 0) -> Profile:
    """Many compute-heavy layers with small weights (25M parameters in all), like ResNet-50."""
    rng = np.random.default_rng(seed)
    compute = rng.uniform(0.5, 1.5, layers)
    compute *= 0.3 * microbatch_size / 64 / compute.sum()
    weights = rng.uniform(0.5, 1.5, layers)
    weights *= 25e6 / weights.sum()
    outputs = rng.uniform(2e4, 8e5, layers)
    return Profile(
        [
            _layer(float(c), float(o) * microbatch_size, float(w), f"block{index}")
            for index, (c, o, w) in enumerate(zip(compute, outputs, weights))
        ],
        microbatch_size=microbatch_size,
        input_bytes=_FLOAT * 3 * 224 * 224 * microbatch_size,
    )


def _layer(compute_s: float, output_elements: float, parameters: float, name: str) -> LayerCost:
    """A layer whose backward costs twice its forward, with Adam state, in fp32."""
    return LayerCost(
        forward_s=compute_s / 3,
        backward_s=2 * compute_s / 3,
        activation_bytes=_FLOAT * output_elements,
        parameter_bytes=_FLOAT * parameters,
        optimizer_bytes=2 * _FLOAT * parameters,
        name=name,
    )
