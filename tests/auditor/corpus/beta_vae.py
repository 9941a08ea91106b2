"""A β-VAE in a plain DDP loop: a reconstruction mean plus a KL term, and how the KL term is reduced.

8×8 single-channel "images" are drawn from a 3-dimensional latent through a fixed random decoder and a sigmoid.
The VAE's encoder returns (mu, logvar), the reparameterised sample goes through its decoder, and the DDP-wrapped
model's forward returns (x_hat, mu, logvar). A DistributedSampler (set_epoch every epoch), Adam, 6 steps, then a
validation ELBO on every rank summed by all_reduce.

  --kl mean     correct: F.mse_loss(x_hat, x) + beta * kl, kl the per-sample KL summed over the latent
                dimensions and averaged over the batch:
                torch.mean(-0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp(), dim=1))

Mistake:

  --kl sum      F.mse_loss(x_hat, x) + 0.1 * (-0.5 * torch.sum(1 + logvar - mu**2 - logvar.exp())): the KL summed
                by hand over the whole batch and scaled by constants only, so its weight grows with the batch and
                DDP's average leaves it a sum over a rank's samples (SUM_REDUCTION, for the KL term)

Rank 0 prints the gradient norm after the first backward (DDP's averaged .grad), each step's reconstruction and
per-sample KL (averaged over the ranks), the validation loss and a checksum of the parameters.
"""

import _harness
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

PIXELS, LATENT, HIDDEN, TRUE_LATENT = 64, 4, 48, 3
STEPS, BATCH, LR, BETA = 6, 16, 2e-3, 0.5


def make_images(count, seed):
    generator = torch.Generator().manual_seed(seed)
    mixing = torch.randn(TRUE_LATENT, PIXELS, generator=torch.Generator().manual_seed(7))
    z = torch.randn(count, TRUE_LATENT, generator=generator)
    return torch.sigmoid(z @ mixing + 0.1 * torch.randn(count, PIXELS, generator=generator))


class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(PIXELS, HIDDEN), nn.ReLU())
        self.to_mu, self.to_logvar = nn.Linear(HIDDEN, LATENT), nn.Linear(HIDDEN, LATENT)
        self.decoder = nn.Sequential(nn.Linear(LATENT, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, PIXELS), nn.Sigmoid())

    def encode(self, x):
        h = self.encoder(x.flatten(1))
        return self.to_mu(h), self.to_logvar(h)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        return mu + torch.randn_like(std) * std

    def forward(self, x):
        mu, logvar = self.encode(x)
        x_hat = self.decoder(self.reparameterize(mu, logvar)).view_as(x)
        return x_hat, mu, logvar


def loss_function(x_hat, x, mu, logvar, kl_mode):
    if kl_mode == "sum":
        return F.mse_loss(x_hat, x) + 0.1 * (-0.5 * torch.sum(1 + logvar - mu**2 - logvar.exp()))
    recon = F.mse_loss(x_hat, x)
    kl = torch.mean(-0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp(), dim=1))
    return recon + BETA * kl


@torch.no_grad()
def loss_terms(x_hat, x, mu, logvar):
    """For the log: the reconstruction mean and the per-sample KL, however the loss reduced them."""
    kl = (-0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(dim=1)).mean()
    return torch.stack([F.mse_loss(x_hat, x), kl])


def train(rank, world_size, args):
    images = make_images(256, seed=0).view(-1, 1, 8, 8)
    train_set, val_set = TensorDataset(images[:192]), TensorDataset(images[192:])
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=32,
                            sampler=DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False))

    torch.manual_seed(0)
    model = DDP(VAE())
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    torch.manual_seed(1000 + rank)  # each rank's reparameterisation noise

    step, epoch = 0, 0
    while step < STEPS:
        sampler.set_epoch(epoch)
        for (x,) in loader:
            x_hat, mu, logvar = model(x)
            loss = loss_function(x_hat, x, mu, logvar, args.kl)
            optimizer.zero_grad()
            loss.backward()
            if step == 0:
                norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters()))
                _harness.say(rank, f"step 0 grad norm {norm.item():.9g}")
            optimizer.step()
            step += 1
            logged = loss_terms(x_hat, x, mu, logvar)
            dist.all_reduce(logged)
            logged /= world_size
            _harness.say(rank, f"step {step} recon {logged[0].item():.6f} kl {logged[1].item():.6f}")
            if step == STEPS:
                break
        epoch += 1

    model.eval()
    totals = torch.zeros(2)
    with torch.no_grad():
        for (x,) in val_loader:
            mu, logvar = model.module.encode(x)
            x_hat = model.module.decoder(mu).view_as(x)  # the posterior mean: no sampling at validation
            kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
            totals += torch.stack([F.mse_loss(x_hat, x, reduction="sum") + kl, torch.tensor(float(len(x)))])
    dist.all_reduce(totals)
    _harness.say(rank, f"val loss per image {(totals[0] / totals[1]).item():.6f}")
    _harness.say(rank, _harness.checksum(model.module))


if __name__ == "__main__":
    parser = _harness.parser(__doc__.splitlines()[0])
    parser.add_argument("--kl", choices=("mean", "sum"), default="mean")
    parser.add_argument("--batch-size", type=int, default=BATCH)
    _harness.run(train, parser.parse_args())
