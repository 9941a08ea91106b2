"""Mistake: a summed loss under DDP's averaging: gradients 1/W of the single-process sum (SUM_REDUCTION)."""

import _harness
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def train(rank, world_size):
    data = _harness.dataset()
    ddp = DDP(_harness.model())
    sampler = DistributedSampler(data, shuffle=True)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.001)
    loss_fn = torch.nn.MSELoss(reduction="sum")
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_size=16, sampler=sampler):
            optimizer.zero_grad()
            loss_fn(ddp(x), y).backward()  # the bug: backward from the sum as it is
            optimizer.step()


if __name__ == "__main__":
    _harness.main(train)
