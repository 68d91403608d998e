"""Functions the heap tests run in fresh processes (the allocator's settings are
process-wide and cannot be undone)."""

from __future__ import annotations

import resource

import torch

WEIGHT_PAGES = 2048 * 1024 * 4 // resource.getpagesize()
"""The pages of the large layer's weight (8 MiB), which its gradient and Adam's temporaries
match in size."""


def faults_per_training_step(warmup: int = 10, steps: int = 60) -> float:
    """Minor page faults per step of a small Adam-trained network whose first layer is as
    large as a VGG's fully connected layer, after ``warmup`` steps. Even with the memory
    kept, the heap now and then grows by a block the size of a gradient (8 MiB), so the
    faults are averaged over enough steps that one such growth is not taken for a step's."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(2048, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)
    )
    optimizer = torch.optim.Adam(model.parameters())
    inputs, targets = torch.randn(32, 2048), torch.randint(0, 10, (32,))

    def step() -> None:
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()  # the gradients are freed, and allocated again next step

    for _ in range(warmup):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        step()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / steps


def kept_then_faults() -> tuple[bool, float]:
    """Whether :func:`pipetrain.runtime.keep_freed_memory` took, and the faults per step
    after it."""
    from pipetrain.runtime import keep_freed_memory

    return keep_freed_memory(), faults_per_training_step()
