"""A small 1-D CNN trained with AdamW on a synthetic signal task: a workload the Adam rules were not tuned on.

Each signal is 64 samples of Gaussian noise (std 0.5) with one of four shapes hidden at a random place, with a random
amplitude and width: a sine burst, a square pulse, a ramp or a tent. The class is the shape.
Everything is generated from fixed seeds, so every rank and every run builds the same data.

    ddplab study examples/adamw_fresh_spec.py --target-accuracy 0.9 --optimizer adamw \
        --rules constant,sqrt,adam-sqrt,adamw-tau,surge,tuned

The page docs/study/adam-rules.md shows that study's scorecard.
"""

import math

import torch

LENGTH = 64
CLASSES = 4


class SignalNet(torch.nn.Module):
    """Two convolutions, a global average over time, a linear head."""

    def __init__(self, channels: int = 16):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv1d(1, channels, kernel_size=5, padding=2), torch.nn.GELU(),
            torch.nn.MaxPool1d(2),
            torch.nn.Conv1d(channels, channels, kernel_size=5, padding=2), torch.nn.GELU(),
        )
        self.head = torch.nn.Linear(channels, CLASSES)

    def forward(self, inputs):
        return self.head(self.features(inputs.unsqueeze(1)).mean(dim=2))


def _shape(kind: int, width: int) -> torch.Tensor:
    t = torch.linspace(0.0, 1.0, width)
    if kind == 0:
        return torch.sin(2 * math.pi * 2 * t)  # two periods of a sine
    if kind == 1:
        return torch.ones(width)  # a square pulse
    if kind == 2:
        return 2 * t - 1  # a ramp
    return 1 - (2 * t - 1).abs()  # a tent


def _split(seed: int, size: int):
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(CLASSES, (size,), generator=generator)
    widths = torch.randint(12, 25, (size,), generator=generator)
    amplitudes = 0.6 + 0.8 * torch.rand(size, generator=generator)
    signals = 0.5 * torch.randn(size, LENGTH, generator=generator)
    for i in range(size):
        width = int(widths[i])
        start = int(torch.randint(LENGTH - width + 1, (1,), generator=generator))
        signals[i, start:start + width] += amplitudes[i] * _shape(int(labels[i]), width)
    return torch.utils.data.TensorDataset(signals, labels)


def model():
    return SignalNet()


def dataset():
    return _split(seed=0, size=8192)


def val_dataset():
    return _split(seed=1, size=1024)


def loss(output, target):
    return torch.nn.functional.cross_entropy(output, target)


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.05)
