"""A BatchNorm CNN whose rank 0 alone validates on the inner module every 2 steps, then all ranks meet at a barrier.

Training batches come from two DataLoader worker processes. Validation runs on `ddp.module` under `torch.no_grad()` in
eval mode: no DDP forward, so no buffer broadcast that the other ranks would have to join. With `--validate-all-ranks`
every rank validates (still through `.module`); with `--through-wrapper` every rank validates through the DDP wrapper
itself (whose first forward after a training step broadcasts rank 0's BatchNorm buffers, and whose next training
forward then does not). 32 images per rank: per-rank BatchNorm statistics are at most an info.

Mistake (`--mistake module-forward`): the training forward calls `ddp.module(x)`, so gradients are never all-reduced
(NO_ALLREDUCE).
"""

import _harness
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SAMPLES, CLASSES, VALIDATE_EVERY = 512, 4, 2


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
            torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(2))
        self.classifier = torch.nn.Linear(16 * 2 * 2, CLASSES)

    def forward(self, images):
        return self.classifier(self.features(images).flatten(1))


def images(samples, seed):
    """Random 1x8x8 images labelled by their brightest quadrant."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 1, 8, 8, generator=generator)
    quadrants = F.avg_pool2d(x, 4).flatten(1)
    return TensorDataset(x, quadrants.argmax(dim=1))


def validate(model, loader):
    model.eval()
    correct, total, loss = 0, 0, 0.0
    with torch.no_grad():
        for x, y in loader:
            logits = model(x)
            loss += F.cross_entropy(logits, y, reduction="sum").item()
            correct += (logits.argmax(dim=1) == y).sum().item()
            total += len(y)
    model.train()
    return loss / total, correct / total


def train(rank, world_size, args):
    train_set, val_set = images(SAMPLES, seed=0), images(128, seed=1)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    # Worker processes forked from the rank: whatever the rank carries, they carry too.
    loader = DataLoader(train_set, batch_size=32, sampler=sampler, num_workers=2, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=64)
    torch.manual_seed(0)
    ddp = DDP(SmallCNN())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    step = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            logits = ddp.module(x) if args.mistake == "module-forward" else ddp(x)
            loss = F.cross_entropy(logits, y)
            loss.backward()
            optimizer.step()
            if step % VALIDATE_EVERY == 0 and (rank == 0 or args.validate_all_ranks or args.through_wrapper):
                val_loss, accuracy = validate(ddp if args.through_wrapper else ddp.module, val_loader)
                _harness.say(rank, f"step {step} train loss {loss.item():.4f} val loss {val_loss:.4f} "
                                   f"accuracy {accuracy:.3f}")
            dist.barrier()
            step += 1
    _harness.say(rank, f"final loss {loss.item():.6f} {_harness.checksum(ddp.module)}")


if __name__ == "__main__":
    parser = _harness.parser(__doc__.splitlines()[0])
    parser.add_argument("--validate-all-ranks", action="store_true")
    parser.add_argument("--through-wrapper", action="store_true", help="every rank validates through the wrapper")
    parser.add_argument("--mistake", choices=("none", "module-forward"), default="none")
    _harness.run(train, parser.parse_args())
