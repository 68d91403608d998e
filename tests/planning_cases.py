"""Profiles shaped like well-known models, and seeded random ones, for the planner tests.

Magnitudes follow PipeDream's setting (V100 GPUs, fp32): VGG-16 at 64 images per
micro-batch takes about 0.34 s forward+backward (PipeDream's committed VGG-16 profile:
672.5 ms at 128); its 13 convolutions hold ~98.5% of the compute and ~11% of the 138M
weights, its 3 fully connected layers ~1.5% and ~89%.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from pipetrain.profiler import LayerCost, Profile, Spread

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


RANDOM_TOPOLOGIES = (
    "4x16GB/s",
    "8x10GB/s",
    "2x16GB/s,2x1GB/s",
    "2x100MB/s,3x10MB/s",
    "6x1GB/s@100us",
    "4x16GB/s,2x1.25GB/s",
    "3x50MB/s",
)


def random_case(seed: int) -> tuple[Profile, dict[str, Any]]:
    """A random profile of 3 to 20 uneven layers (a weight-gradient share measured or not,
    measured runs or not) and :func:`pipetrain.planning.plan` arguments for it: a topology
    of :data:`RANDOM_TOPOLOGIES`, with or without replication, a batch size, a memory limit
    that may bind, shared cores."""
    rng = random.Random(seed)
    costs = []
    for index in range(rng.randint(3, 20)):
        forward = rng.uniform(1e-3, 1e-2) * rng.choice([1, 1, 3])
        backward = forward * rng.uniform(1.5, 2.5)
        costs.append(
            LayerCost(
                forward_s=forward,
                backward_s=backward,
                activation_bytes=rng.uniform(1e4, 1e7),
                parameter_bytes=rng.uniform(0, 4e7),
                optimizer_bytes=rng.uniform(0, 8e7),
                weight_backward_s=backward * rng.uniform(0.2, 0.6) if rng.random() < 0.5 else None,
                optimizer_s=rng.uniform(0, 1e-3),
                name=f"layer{index}",
            )
        )
    spread = None
    if rng.random() < 0.3:
        runs = [[rng.lognormvariate(0, 0.2) for _ in costs] for _ in range(3)]
        spread = Spread(
            [[layer.forward_s * f for layer, f in zip(costs, run)] for run in runs],
            [[layer.backward_s * f for layer, f in zip(costs, run)] for run in runs],
        )
    profile = Profile(
        costs,
        microbatch_size=rng.choice([1, 4, 8]),
        input_bytes=rng.uniform(1e4, 1e6),
        message_s=rng.choice([0.0, 1e-4]),
        spread=spread,
    )
    arguments: dict[str, Any] = {
        "topology": rng.choice(RANDOM_TOPOLOGIES),
        "replication": rng.random() < 0.7,
    }
    if rng.random() < 0.4:
        arguments["batch_size"] = profile.microbatch_size * rng.choice([8, 16, 64])
    if rng.random() < 0.4:
        state = sum(layer.parameter_bytes + layer.optimizer_bytes for layer in costs)
        arguments["memory_limit"] = state * rng.uniform(0.3, 1.5)
    if rng.random() < 0.1:  # slow to plan: each candidate is simulated several times
        arguments["shared_cores"] = 2
    return profile, arguments
