"""Dropout: every rank draws its own masks, so only a distributional comparison is meaningful."""

import torch
from correct import dataset, loss  # noqa: F401


def model():
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 2))
