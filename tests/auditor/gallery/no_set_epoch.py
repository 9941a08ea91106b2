"""Mistake: set_epoch is never called, so every epoch repeats the same order (SET_EPOCH_MISSING)."""

import _harness
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def train(rank, world_size):
    data = _harness.dataset()
    ddp = DDP(_harness.model())
    loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data, shuffle=True))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for _epoch in range(2):  # the bug: no loader.sampler.set_epoch(_epoch)
        for x, y in loader:
            optimizer.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            optimizer.step()


if __name__ == "__main__":
    _harness.main(train)
