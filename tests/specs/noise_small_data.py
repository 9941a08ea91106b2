"""A 500-sample classification set at a fixed checkpoint (lr 0): finite-dataset noise scale."""

import torch

SAMPLES = 500


def model():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def dataset():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(SAMPLES, 8, generator=g)
    # Labels follow x only loosely, so per-sample gradients spread widely around their mean.
    score = x[:, 0] + 0.5 * x[:, 1] + 1.5 * torch.randn(SAMPLES, generator=g)
    y = (score > -0.5).long() + (score > 0.8).long()
    return torch.utils.data.TensorDataset(x, y)


def loss(output, target):
    return torch.nn.functional.cross_entropy(output, target)


def optimizer(params):
    # lr 0 holds the weights, so every step measures the same |G|² and tr Σ.
    return torch.optim.SGD(params, lr=0.0)
