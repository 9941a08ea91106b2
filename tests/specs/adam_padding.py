"""Adam on a dataset of 1001 samples: 3 ranks pad it with repeats at the end of each epoch."""

import torch
from correct import loss, model  # noqa: F401


def dataset():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1001, 6, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, 2] > 0).long())


def optimizer(params):
    return torch.optim.Adam(params, lr=1e-2)
