"""Bug: a loss normalised by a per-rank count (the positives in each rank's batch), as token-count losses are.
DDP averages per-rank means of different sizes: not the global mean, and nowhere near a factor of W."""

import torch
from correct import dataset, model  # noqa: F401


def loss(output, target):
    positives = (target == 1).sum().clamp_min(1)
    return torch.nn.functional.cross_entropy(output, target, reduction="sum") / positives
