"""Linear regression with Gaussian inputs, weights held fixed (lr 0): B_simple has a closed form.

Per-sample gradient of (x·w − y)² at w with d = w − w*: g = 2(x·d − ε)x, so |G|² = 4|d|² and
tr Σ = 4((D + 1)|d|² + D·s²), so B_simple = TRUE_B_SIMPLE below.
"""

import torch

D = 10
NOISE_STD = 1.0
SAMPLES = 60_000
# |d|² = D (w = 0, w* = 1): B_simple = ((D + 1)·D + D·s²) / D.
TRUE_B_SIMPLE = ((D + 1) * D + D * NOISE_STD ** 2) / D


def model():
    layer = torch.nn.Linear(D, 1, bias=False)
    torch.nn.init.zeros_(layer.weight)
    return layer


def dataset():
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, D, generator=generator)
    y = x.sum(dim=1, keepdim=True) + NOISE_STD * torch.randn(SAMPLES, 1, generator=generator)
    return torch.utils.data.TensorDataset(x, y)


def loss(output, target):
    return torch.nn.functional.mse_loss(output, target)


def optimizer(params):
    # lr 0 holds the weights where the closed form is known.
    return torch.optim.SGD(params, lr=0.0)
