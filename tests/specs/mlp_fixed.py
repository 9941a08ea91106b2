"""A small MLP at a fixed checkpoint (lr 0) on synthetic classification data."""

import torch


def model():
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))


def dataset():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40_000, 8, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return torch.utils.data.TensorDataset(x, y)


def loss(output, target):
    return torch.nn.functional.cross_entropy(output, target)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.0)
