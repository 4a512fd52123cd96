"""The training objective every trainplan run uses: the LM loss the capture traces and the executor
minimizes."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, nats. logits (b, s, V), labels (b, s) already shifted."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
