"""Noiseless linear regression with Gaussian inputs, weights held fixed (lr 0): B_simple = D + 1.

At w = 0 with y = x·w* the per-sample gradient of (x·w − y)² is g = −2x(x·w*), whose mean is −2w* and whose
covariance is 4(w*w*ᵀ + |w*|² I): tr Σ / |G|² = (|w*|² + D|w*|²) / |w*|² = D + 1, whatever w*. The linear
layer sits in a Sequential, so FSDP2 shards it as a group of its own below the root.
"""

import torch

D = 15
SAMPLES = 60_000
TRUE_B_SIMPLE = D + 1


def model():
    layer = torch.nn.Linear(D, 1, bias=False)
    torch.nn.init.zeros_(layer.weight)
    return torch.nn.Sequential(layer)


def dataset():
    generator = torch.Generator().manual_seed(4321)
    x = torch.randn(SAMPLES, D, generator=generator)
    w_star = torch.randn(D, 1, generator=generator)
    return torch.utils.data.TensorDataset(x, x @ w_star)


def loss(output, target):
    return torch.nn.functional.mse_loss(output, target)


def optimizer(params):
    # lr 0 holds the weights where the closed form is known.
    return torch.optim.SGD(params, lr=0.0)
