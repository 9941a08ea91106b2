"""Bug: a summed loss, plus an L2 penalty added in step(). The penalty is not summed over the batch, so the
gradients are no longer exactly 1/W of the single process's: still a summed loss, and it must be named so."""

import torch
from correct import dataset, model  # noqa: F401


def loss(output, target):
    return torch.nn.functional.cross_entropy(output, target, reduction="sum")


def step(net, batch, loss_fn):
    inputs, target = batch
    return loss_fn(net(inputs), target) + 1e-4 * sum(p.pow(2).sum() for p in net.parameters())
