"""A spec for ddplab study that only the DDP engine trains: BatchNorm and its own step() (label smoothing)."""
import torch


def model():
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 2))


def _data(seed, n=1024):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, 0] * x[:, 1] > 0).long())


def dataset():
    return _data(1)


def val_dataset():
    return _data(2, 512)


def loss(output, target):
    return torch.nn.functional.cross_entropy(output, target)


def step(model, batch, loss_fn):
    inputs, targets = batch
    # Label smoothing in the step, as a training loop might add it.
    return torch.nn.functional.cross_entropy(model(inputs), targets, label_smoothing=0.05)
