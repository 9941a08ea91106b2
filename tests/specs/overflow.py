"""A learning rate far too large: the loss grows without bound until it overflows float64.

Each step multiplies the weights by about lr·|x|², so they overflow after a few steps, in DDP
and in one process alike.
"""

import torch


def model():
    return torch.nn.Linear(6, 1)


def dataset():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1000, 6, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))


def loss(output, target):
    return torch.nn.functional.mse_loss(output, target)


def optimizer(params):
    return torch.optim.SGD(params, lr=1e60)
