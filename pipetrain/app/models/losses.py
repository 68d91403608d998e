"""The loss of the built-in classifiers (the MLPs, the CNN and the VGG-style network)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def classification_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of class logits (N, C) against labels (N,)."""
    return F.cross_entropy(logits, targets)
