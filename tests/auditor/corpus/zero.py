"""DDP with ZeroRedundancyOptimizer: each rank's inner Adam owns and steps only its shard of the parameters.

The wrapper's optimizer steps on every rank; the inner Adam steps a different set of parameters on each
rank (the layers are of unequal sizes, so the shards are too). Rank 0 checkpoints the consolidated optimizer
state at the end, as sharded-optimizer programs do.
"""

import _harness
import torch
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

FEATURES, SAMPLES = 12, 256


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 48), torch.nn.Tanh(), torch.nn.Linear(48, 24),
                               torch.nn.Tanh(), torch.nn.Linear(24, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))


def train(rank, world_size, args):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    data = TensorDataset(x, torch.sin(x[:, :3]).sum(dim=1, keepdim=True))
    sampler = DistributedSampler(data, shuffle=True, seed=1)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    ddp = DDP(model())
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=3e-3)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            optimizer.zero_grad()
            loss = F.mse_loss(ddp(inputs), targets)
            loss.backward()
            optimizer.step()
        _harness.say(rank, f"epoch {epoch} loss {loss.item():.6f}")
    optimizer.consolidate_state_dict(to=0)  # a collective: every rank takes part
    if rank == 0:
        state = optimizer.state_dict()
        _harness.emit(f"optimizer state for {len(state['state'])} parameters")
    _harness.say(rank, f"final loss {loss.item():.6f} {_harness.checksum(ddp.module)}")


if __name__ == "__main__":
    _harness.run(train, _harness.parser(__doc__.splitlines()[0]).parse_args())
