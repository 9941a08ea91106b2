"""A loss normalised by a per-rank count that can be 0: nan on a rank, finite on the global batch.

Two samples, one of them positive. With 2 ranks of 1 sample, the rank holding the negative one
divides 0 by 0; one process sees both samples and one positive.
"""

import torch


def model():
    return torch.nn.Linear(3, 1)


def dataset():
    x = torch.tensor([[1.0, 0.5, -0.2], [0.3, -1.0, 0.8]])
    return torch.utils.data.TensorDataset(x, torch.tensor([[1.0], [0.0]]))


def loss(output, target):
    positive = target > 0
    # Mean squared error over the positive samples of this batch only.
    return ((output - target) ** 2 * positive).sum() / positive.sum()
