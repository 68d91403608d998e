"""What a loss function may return, and a token-level loss for causal language models.

A ``loss_fn`` returns either a scalar (the micro-batch's mean loss, weighted by the
micro-batch's share of the samples) or a pair ``(loss_sum, count)``: then the step's loss
is the sum of every micro-batch's ``loss_sum`` over the sum of their ``count``, as the
unpipelined model's ``total_sum / total_count`` on the whole batch (a token mean over a
padded batch, say). :func:`causal_lm_loss` returns such a pair.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def split_loss(result: Any, who: str, where: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A loss function's ``result`` as ``(loss, count)`` in float32: ``count`` is ``None``
    for a scalar loss. ValueError names the function (``who``), the place (``where``) and
    the shape of anything else."""
    if isinstance(result, (tuple, list)) and len(result) == 2:
        loss, count = result
        if isinstance(count, (int, float)) and not isinstance(count, bool):
            count = torch.tensor(float(count), device=_device(loss))
        if _scalar(loss) and _scalar(count):
            return loss.float(), count.detach().float().to(loss.device)
        raise ValueError(
            f"{who} returned a pair {where} that is not (loss_sum, count): both must be scalars "
            f"(a tensor and a tensor or number), got ({_shape(loss)}, {_shape(count)})"
        )
    if _scalar(result):
        return result.float(), None
    raise ValueError(
        f"{who} returned {_shape(result)} {where}, not a scalar: it must reduce over the batch "
        "(e.g. reduction='mean'), or return (loss_sum, count) for a mean over counted items"
    )


def causal_lm_loss(
    output: Any, labels: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed next-token cross-entropy of a causal language model and the number of
    tokens it counts, for ``Pipeline(loss_fn=causal_lm_loss)``.

    ``output`` is the logits ``[batch, sequence, vocabulary]``, or holds them as Hugging
    Face model outputs do (a ``logits`` attribute or key, or the first element of a
    tuple). As Hugging Face causal models shift them, ``logits[:, :-1]`` predict
    ``labels[:, 1:]``; labels equal to ``ignore_index`` (padding) are not counted. Returns
    ``(sum of the token losses in float32, count of counted tokens)``, so the pipeline's
    loss is the mean over every counted token of the step.
    """
    logits = _logits(output)
    shifted = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    targets = labels[:, 1:].reshape(-1).to(shifted.device)
    total = nn.functional.cross_entropy(
        shifted, targets, ignore_index=ignore_index, reduction="sum"
    )
    return total, (targets != ignore_index).sum()


def _logits(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and "logits" in output:
        logits = output["logits"]
    elif hasattr(output, "logits"):
        logits = output.logits
    elif isinstance(output, (tuple, list)) and output:
        logits = output[0]
    else:
        logits = None
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            f"causal_lm_loss needs logits: a tensor, or an output with a 'logits' attribute "
            f"or key, or a tuple starting with them; got {type(output).__name__}"
        )
    return logits


def _scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0


def _device(value: Any) -> torch.device:
    return value.device if isinstance(value, torch.Tensor) else torch.device("cpu")


def _shape(value: Any) -> str:
    return str(list(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__
