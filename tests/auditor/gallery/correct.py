"""Correct: sharded data with set_epoch, DDP forward, no_sync accumulation, a summed loss divided by its count."""

from contextlib import nullcontext

import _harness
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

ACCUMULATION = 2


def train(rank, world_size):
    data = _harness.dataset()
    ddp = DDP(_harness.model(batchnorm=True))  # 16 samples per rank: per-rank statistics are an info
    sampler = DistributedSampler(data, shuffle=True)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            last = (i + 1) % ACCUMULATION == 0
            with nullcontext() if last else ddp.no_sync():
                # Token-sum normalisation: summing then dividing by a count is a mean, and correct.
                loss = F.mse_loss(ddp(x), y, reduction="sum") / y.numel() / ACCUMULATION
                loss.backward()
            if last:
                optimizer.step()
                optimizer.zero_grad()
                with torch.no_grad():  # a quick evaluation between steps is no training forward
                    ddp.eval()
                    ddp(x)
                    ddp.train()


if __name__ == "__main__":
    _harness.main(train)
