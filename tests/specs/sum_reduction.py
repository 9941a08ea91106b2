"""Bug: a summed loss. Under DDP's averaging its gradient is 1/W of the single-process sum."""

import torch
from correct import dataset, model  # noqa: F401


def loss(output, target):
    return torch.nn.functional.cross_entropy(output, target, reduction="sum")
