"""Three epochs of eight steps, leaving either through the ordinary teardown or through os._exit.

The tests audit it with a window shorter than the run (`ddplab audit --steps 2`) and longer than the run
(`--steps 50`: the window never closes). `--exit os-exit` makes every rank flush and call `os._exit(0)` right
after training, without destroying the process group, as programs do to skip a slow or hanging teardown: no
at-exit code runs.
"""

import os

import _harness
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

FEATURES, EPOCHS, STEPS_PER_EPOCH, BATCH = 6, 3, 8, 8


def train(rank, world_size, args):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(world_size * STEPS_PER_EPOCH * BATCH, FEATURES, generator=generator)
    data = TensorDataset(x, x @ torch.linspace(-1, 1, FEATURES).unsqueeze(1))
    sampler = DistributedSampler(data, shuffle=True)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    steps = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            optimizer.zero_grad()
            loss = F.mse_loss(ddp(inputs), targets)
            loss.backward()
            optimizer.step()
            steps += 1
        _harness.say(rank, f"epoch {epoch} loss {loss.item():.6f}")
    _harness.say(rank, f"final loss {loss.item():.6f} after {steps} steps {_harness.checksum(ddp.module)}")
    if args.exit == "os-exit":
        os._exit(0)


if __name__ == "__main__":
    parser = _harness.parser(__doc__.splitlines()[0])
    parser.add_argument("--exit", choices=("return", "os-exit"), default="return")
    _harness.run(train, parser.parse_args())
