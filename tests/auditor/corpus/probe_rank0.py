"""Ordinary DDP training, plus a linear probe that rank 0 alone trains on the frozen features every step.

DDP keeps the gradients as views into its buckets (gradient_as_bucket_view=True). The probe is a plain
nn.Linear (no DDP) with its own optimizer; it reads the encoder's features under no_grad through
`ddp.module.encoder`. Its optimizer steps on rank 0 only, so nothing the other rank waits for may hang on it.
"""

import _harness
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

FEATURES, SAMPLES = 10, 256


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(FEATURES, 24), torch.nn.ReLU())
        self.head = torch.nn.Linear(24, 1)

    def forward(self, x):
        return self.head(self.encoder(x))


def train(rank, world_size, args):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    # The probe's target is a property the main task never asks for.
    data = TensorDataset(x, x[:, :4].sum(dim=1, keepdim=True), (x[:, 5] > 0).long())
    sampler = DistributedSampler(data, shuffle=True)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    torch.manual_seed(0)
    ddp = DDP(Regressor(), gradient_as_bucket_view=True)  # gradients are views into DDP's buckets
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    probe = torch.nn.Linear(24, 2) if rank == 0 else None
    probe_optimizer = torch.optim.SGD(probe.parameters(), lr=0.1) if rank == 0 else None
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for inputs, targets, probe_targets in loader:
            optimizer.zero_grad()
            loss = F.mse_loss(ddp(inputs), targets)
            loss.backward()
            optimizer.step()
            if rank == 0:
                with torch.no_grad():
                    features = ddp.module.encoder(inputs)
                probe_optimizer.zero_grad()
                probe_loss = F.cross_entropy(probe(features), probe_targets)
                probe_loss.backward()
                probe_optimizer.step()
        if rank == 0:
            _harness.emit(f"epoch {epoch} loss {loss.item():.6f} probe loss {probe_loss.item():.6f}")
    _harness.say(rank, f"final loss {loss.item():.6f} {_harness.checksum(ddp.module)}")


if __name__ == "__main__":
    _harness.run(train, _harness.parser(__doc__.splitlines()[0]).parse_args())
