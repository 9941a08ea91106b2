"""A forward that uses its second head on even steps only: the first batch uses every parameter.

The trial batch cannot see that anything is unused, so DDP first runs without
find_unused_parameters and fails at step 2; ddplab starts the ranks again with it.
"""

import torch
from correct import dataset, loss, optimizer  # noqa: F401


class EvenStepsHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(6, 2)
        self.even_head = torch.nn.Linear(6, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        out = self.head(x)
        return out + self.even_head(x) if self.calls % 2 == 1 else out


def model():
    return EvenStepsHead()
