"""Mistake: after the first step rank 1 nudges one bias entry by 3e-5, next to a 1024x1024 weight (PARAMS_DIVERGED).

From then on the ranks train two different models, forever 3e-5 apart in that entry. A checksum over all
parameters together is dominated by the large weight and cannot see it; a comparison tensor by tensor can.
"""

import _harness
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WIDTH, STEPS, BATCH = 1024, 8, 8


def train(rank, world_size, args):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 1))
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)  # each rank its own shard of an endless stream
    for step in range(STEPS):
        inputs = torch.randn(BATCH, WIDTH, generator=generator)
        optimizer.zero_grad()
        loss = F.mse_loss(ddp(inputs), inputs[:, :1])
        loss.backward()
        optimizer.step()
        if step == 0 and rank == 1:
            with torch.no_grad():
                model[0].bias[0] += 3e-5
    _harness.say(rank, f"final loss {loss.item():.6f} {_harness.checksum(model)}")


if __name__ == "__main__":
    _harness.run(train, _harness.parser(__doc__.splitlines()[0]).parse_args())
