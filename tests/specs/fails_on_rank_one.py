"""A forward that raises on DDP rank 1 only: the error must come back from the rank as one line."""

import torch
import torch.distributed as dist
from correct import dataset, loss  # noqa: F401


class Fragile(torch.nn.Linear):
    def forward(self, x):
        if dist.is_initialized() and dist.get_rank() == 1:
            raise RuntimeError("rank one cannot read its shard")
        return super().forward(x)


def model():
    return Fragile(6, 2)
