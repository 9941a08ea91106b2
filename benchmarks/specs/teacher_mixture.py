"""A study spec: a student MLP learning a random teacher network's labels, 10% of them flipped.

32 Gaussian features; the teacher is a fixed random two-layer tanh network; labels are its argmax
over 4 classes, with 10% replaced at random (the best reachable accuracy is about 0.925). 16,384
training and 4,096 validation samples.
"""

import torch

FEATURES, CLASSES, FLIP = 32, 4, 0.10


def _split(seed, size):
    g = torch.Generator().manual_seed(seed)
    teacher_g = torch.Generator().manual_seed(1234)
    w1 = torch.randn(FEATURES, 64, generator=teacher_g) / FEATURES ** 0.5
    w2 = torch.randn(64, CLASSES, generator=teacher_g) / 8
    x = torch.randn(size, FEATURES, generator=g)
    y = (torch.tanh(x @ w1) @ w2).argmax(1)
    flip = torch.rand(size, generator=g) < FLIP
    y[flip] = torch.randint(0, CLASSES, (int(flip.sum()),), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def model():
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 128), torch.nn.ReLU(), torch.nn.Linear(128, CLASSES))


def dataset():
    return _split(0, 16384)


def val_dataset():
    return _split(1, 4096)


def loss(output, target):
    return torch.nn.functional.cross_entropy(output, target)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)
