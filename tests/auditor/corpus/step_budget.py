"""A step-budget trainer (`--max-steps`, not epochs) over an endless batch generator, as iteration-based codebases loop.

`batches()` wraps the DataLoader: it calls `sampler.set_epoch(epoch)` at the start of every pass and starts over
when a pass ends. An epoch is 8 optimizer steps per rank; the default budget of 10 steps ends 2 batches into the
second pass. A linear warmup then cosine decay sets the lr every step (LambdaLR).

Mistake (`--mistake frozen-epoch`): the epoch given to set_epoch is the run's start epoch (`args.start_epoch`, 0
unless resuming), so it never advances: the second pass repeats the first one's order from its first batch
(SET_EPOCH_MISSING).
"""

import math

import _harness
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

FEATURES, BATCH, STEPS_PER_EPOCH, WARMUP, PEAK_LR = 10, 8, 8, 3, 0.02


def batches(loader, sampler, start_epoch, mistake):
    epoch = start_epoch
    while True:
        sampler.set_epoch(start_epoch if mistake == "frozen-epoch" else epoch)
        yield from loader
        epoch += 1


def train(rank, world_size, args):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(world_size * STEPS_PER_EPOCH * BATCH, FEATURES, generator=generator)
    data = TensorDataset(x, x.sin() @ torch.linspace(-1, 1, FEATURES).unsqueeze(1))
    sampler = DistributedSampler(data, shuffle=True, seed=7)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.GELU(), torch.nn.Linear(32, 1)))
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=PEAK_LR, weight_decay=0.01)

    def schedule(step):
        if step < WARMUP:
            return (step + 1) / WARMUP
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - WARMUP) / max(1, args.max_steps - WARMUP))))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    stream = batches(loader, sampler, args.start_epoch, args.mistake)
    for step in range(args.max_steps):
        inputs, targets = next(stream)
        loss = F.mse_loss(ddp(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        if step % 4 == 0:
            _harness.say(rank, f"step {step} loss {loss.item():.6f} lr {scheduler.get_last_lr()[0]:.6f}")
    _harness.say(rank, f"final loss {loss.item():.6f} {_harness.checksum(ddp.module)}")


if __name__ == "__main__":
    parser = _harness.parser(__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--start-epoch", type=int, default=0)
    parser.add_argument("--mistake", choices=("none", "frozen-epoch"), default="none")
    _harness.run(train, parser.parse_args())
