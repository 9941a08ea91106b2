"""An ImageNet-style training script: main_worker per rank, AverageMeter, StepLR, validation and a checkpoint.

Shaped like pytorch/examples' imagenet/main.py, which wraps the model in DistributedDataParallel only when a GPU is
there ("using CPU, this will be slow"): on a CPU machine each rank joins the process group and shards the data with
DistributedSampler, yet trains its own model. By default (`--sync ddp`) the model is wrapped on CPU too. With
`--sync hand` no DDP model is built and the gradients are averaged by an explicit all-reduce after backward, as some
research code does: correct, and it must stay clean.

Mistake (`--sync none`): the example's own CPU path, no DDP and no all-reduce: every rank trains alone
(NOT_DISTRIBUTED).
"""

import os
import shutil
import tempfile

import _harness
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SAMPLES, CLASSES, EPOCHS, BATCH = 384, 5, 2, 16


class AverageMeter:
    """Computes and stores the average and current value, as the example's does."""

    def __init__(self, name: str):
        self.name, self.sum, self.count = name, 0.0, 0

    def update(self, value: float, n: int = 1) -> None:
        self.sum += value * n
        self.count += n

    @property
    def avg(self) -> float:
        return self.sum / max(self.count, 1)


def tiny_resnet() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, CLASSES))


def fake_imagenet(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 3, 8, 8, generator=generator)
    return TensorDataset(x, x.mean(dim=(2, 3)).argmax(dim=1) % CLASSES)


def accuracy(output: torch.Tensor, target: torch.Tensor) -> float:
    return (output.argmax(dim=1) == target).float().mean().item() * 100


def average_gradients(model: torch.nn.Module, world_size: int) -> None:
    """The hand-written all-reduce some code uses instead of DDP."""
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad /= world_size


def train_one_epoch(loader, model, optimizer, epoch, rank, world_size, sync):
    losses, top1 = AverageMeter("Loss"), AverageMeter("Acc@1")
    model.train()
    for images, target in loader:
        output = model(images)
        loss = F.cross_entropy(output, target)
        losses.update(loss.item(), images.size(0))
        top1.update(accuracy(output, target), images.size(0))
        optimizer.zero_grad()
        loss.backward()
        if sync == "hand":
            average_gradients(model, world_size)
        optimizer.step()
    _harness.say(rank, f"Epoch: [{epoch}] Loss {losses.avg:.4f} Acc@1 {top1.avg:.2f}")


def validate(loader, model) -> float:
    top1 = AverageMeter("Acc@1")
    model.eval()
    with torch.no_grad():
        for images, target in loader:
            top1.update(accuracy(model(images), target), images.size(0))
    return top1.avg


def main_worker(rank, world_size, args):
    model = tiny_resnet()
    if args.sync == "ddp":
        model = DistributedDataParallel(model)
    elif rank == 0:
        _harness.emit("using CPU, this will be slow")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
    train_set, val_set = fake_imagenet(SAMPLES, seed=0), fake_imagenet(96, seed=1)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=BATCH, sampler=sampler)
    val_loader = DataLoader(val_set, batch_size=BATCH)
    checkpoints = tempfile.mkdtemp(prefix="imagenet-style-")
    try:
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            train_one_epoch(loader, model, optimizer, epoch, rank, world_size, args.sync)
            scheduler.step()
            acc1 = validate(val_loader, model)
            _harness.say(rank, f" * Acc@1 {acc1:.3f}")
            if rank == 0:
                torch.save({"epoch": epoch + 1, "state_dict": model.state_dict(),
                            "optimizer": optimizer.state_dict()}, os.path.join(checkpoints, "checkpoint.pth.tar"))
    finally:
        shutil.rmtree(checkpoints, ignore_errors=True)
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    _harness.say(rank, _harness.checksum(inner))


if __name__ == "__main__":
    parser = _harness.parser(__doc__)
    parser.add_argument("--sync", choices=("ddp", "hand", "none"), default="ddp")
    _harness.run(main_worker, parser.parse_args())
