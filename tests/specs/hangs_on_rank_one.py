"""A linear classifier whose rank 1 stalls in its first step() (stuck, say, reading its shard from a slow disk): rank 0
waits in the reduction's collective until the process group's timeout; the rank to name is rank 1."""

import time

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset


def dataset():
    return TensorDataset(torch.randn(64, 6), torch.randint(0, 2, (64,)))


def loss(output, target):
    return torch.nn.functional.cross_entropy(output, target)


def model():
    return torch.nn.Linear(6, 2)


def step(model, batch, loss_fn):
    if dist.is_initialized() and dist.get_rank() == 1:
        time.sleep(600)
    inputs, target = batch
    return loss_fn(model(inputs), target)
