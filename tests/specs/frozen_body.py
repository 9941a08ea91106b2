"""A frozen feature layer (requires_grad=False, as a fine-tune freezes its backbone) under a trained head, SGD with
weight decay: correct; under ZeRO-3 the frozen weights are partitioned with no fp32 master copy, and must still be
compared whole."""

import torch
from correct import dataset, loss  # noqa: F401


def model():
    body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh())
    body.requires_grad_(False)
    return torch.nn.Sequential(body, torch.nn.Linear(16, 2))


def optimizer(params):
    return torch.optim.SGD([p for p in params if p.requires_grad], lr=0.1, momentum=0.9, weight_decay=0.1)
