"""Mistake: gradient accumulation without no_sync: right result, 4× the communication \
(ACCUMULATION_SYNCS_EVERY_STEP)."""

import _harness
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

ACCUMULATION = 4


def train(rank, world_size):
    data = _harness.dataset()
    ddp = DDP(_harness.model())
    sampler = DistributedSampler(data, shuffle=True)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(DataLoader(data, batch_size=8, sampler=sampler)):
            (F.mse_loss(ddp(x), y) / ACCUMULATION).backward()  # the bug: every micro-step all-reduces
            if (i + 1) % ACCUMULATION == 0:
                optimizer.step()
                optimizer.zero_grad()


if __name__ == "__main__":
    _harness.main(train)
