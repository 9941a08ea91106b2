"""A spec for ddplab study whose optimizer the vectorized engine lacks: RMSprop, so its runs train on the DDP
engine with the spec's own optimizer."""
import torch


def model():
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))


def _data(seed, n=1024):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, 0] + x[:, 1] * x[:, 2] > 0).long())


def dataset():
    return _data(1)


def val_dataset():
    return _data(2, 512)


def loss(output, target):
    return torch.nn.functional.cross_entropy(output, target)


def optimizer(params):
    return torch.optim.RMSprop(params, lr=0.02, alpha=0.9)
