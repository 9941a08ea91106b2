"""BatchNorm on 4 samples per rank without SyncBatchNorm: per-rank statistics, a choice (BATCHNORM_NOT_SYNCED, info)."""

import _harness
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def train(rank, world_size):
    data = _harness.dataset()
    ddp = DDP(_harness.model(batchnorm=True))  # per-rank statistics over 4 samples
    sampler = DistributedSampler(data, shuffle=True)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_size=4, sampler=sampler):
            optimizer.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            optimizer.step()


if __name__ == "__main__":
    _harness.main(train)
