"""An auxiliary head the forward never uses: DDP needs find_unused_parameters=True for it.

SGD with weight decay would move the head if it received a zero gradient instead of none,
so an exact comparison also checks that it is left alone on both sides.
"""

import torch
from correct import dataset, loss  # noqa: F401


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh())
        self.head = torch.nn.Linear(16, 2)
        self.aux_head = torch.nn.Linear(16, 2)

    def forward(self, x):
        return self.head(self.body(x))


def model():
    return TwoHeads()


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)
