"""Mistake: no DistributedSampler, so every rank trains on the same batches (SAME_DATA_ON_ALL_RANKS)."""

import _harness
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader


def train(rank, world_size):
    data = _harness.dataset()
    ddp = DDP(_harness.model())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for x, y in DataLoader(data, batch_size=16):  # the bug: every rank iterates the whole dataset
        optimizer.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        optimizer.step()


if __name__ == "__main__":
    _harness.main(train)
