"""A GAN under DDP: two wrappers (generator G, discriminator D), two optimizers, each stepping only its own model.

D is called on a real batch and on a detached fake batch before one backward of the summed loss. The G step
(`--g-step`) either freezes D's parameters (`requires_grad_(False)`) so its backward reaches only G
(`freeze`), or lets the backward fill D's gradients too, which D's next zero_grad discards, as the DCGAN
example does (`plain`). The generator's noise is per-rank random.
"""

import _harness
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

NOISE, SAMPLES = 4, 512


def real_points():
    """A ring of 2-D points: the distribution G learns."""
    generator = torch.Generator().manual_seed(0)
    angle = 2 * torch.pi * torch.rand(SAMPLES, generator=generator)
    radius = 1 + 0.05 * torch.randn(SAMPLES, generator=generator)
    return TensorDataset(torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1))


def networks():
    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(NOISE, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    discriminator = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.LeakyReLU(0.2), torch.nn.Linear(32, 1))
    return generator, discriminator


def train(rank, world_size, args):
    data = real_points()
    sampler = DistributedSampler(data, shuffle=True)
    loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True)
    generator, discriminator = networks()
    netG, netD = DDP(generator), DDP(discriminator)
    optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999))
    optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999))
    noise_generator = torch.Generator().manual_seed(100 + rank)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for (real,) in loader:
            ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
            # (1) D: maximise log(D(x)) + log(1 - D(G(z)))
            optimizerD.zero_grad()
            fake = netG(torch.randn(len(real), NOISE, generator=noise_generator))
            errD = (F.binary_cross_entropy_with_logits(netD(real), ones)
                    + F.binary_cross_entropy_with_logits(netD(fake.detach()), zeros))
            errD.backward()
            optimizerD.step()
            # (2) G: maximise log(D(G(z)))
            optimizerG.zero_grad()
            if args.g_step == "freeze":
                netD.requires_grad_(False)
            errG = F.binary_cross_entropy_with_logits(netD(fake), ones)
            errG.backward()
            optimizerG.step()
            if args.g_step == "freeze":
                netD.requires_grad_(True)
        _harness.say(rank, f"epoch {epoch} loss D {errD.item():.6f} loss G {errG.item():.6f}")
    _harness.say(rank, f"final loss {errD.item() + errG.item():.6f} G {_harness.checksum(generator)} "
                       f"D {_harness.checksum(discriminator)}")


if __name__ == "__main__":
    parser = _harness.parser(__doc__.splitlines()[0])
    parser.add_argument("--g-step", choices=("freeze", "plain"), default="freeze")
    _harness.run(train, parser.parse_args())
