"""A tutorial-shaped classifier loop with gradient accumulation: `loss / accum`, no_sync on all but the last micro-step.

The criterion is an `nn.CrossEntropyLoss` module built once, as tutorials write it, plus an L2 term on the head.
Correct losses (`--loss`): `mean` (the default reduction, then `/ accum`), and `sum-per-sample`: the criterion sums
over the micro-batch and the loop divides by the samples it holds and by the accumulation steps, a mean written by
hand. With `--accum 1` the division by the accumulation steps divides by 1. `--grad-scaler` runs backward from
the loss times a GradScaler's scale and unscales the gradients before the clip, as mixed-precision recipes do.

Mistake (`--loss sum`): `CrossEntropyLoss(reduction='sum')` then `loss / accum`, which still sums over the samples:
the gradient grows with the per-device batch and DDP divides by the world size (SUM_REDUCTION), with any `--accum`.
"""

import contextlib

import _harness
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

FEATURES, CLASSES, SAMPLES, EPOCHS, L2 = 24, 6, 512, 2, 1e-4


def dataset():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    return TensorDataset(x, (x[:, :CLASSES] + 0.2 * torch.randn(SAMPLES, CLASSES, generator=generator)).argmax(1))


def train(rank, world_size, args):
    data = dataset()
    sampler = DistributedSampler(data, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 48), torch.nn.ReLU(), torch.nn.Linear(48, CLASSES))
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    criterion = torch.nn.CrossEntropyLoss(reduction="mean" if args.loss == "mean" else "sum")
    # The mixed-precision recipe's loss scaling: backward from loss × 1024, the gradients divided back before the clip.
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if args.grad_scaler else None
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        optimizer.zero_grad()
        for i, (x, y) in enumerate(loader):
            last_micro_step = (i + 1) % args.accum == 0
            with contextlib.nullcontext() if last_micro_step else ddp.no_sync():
                loss = criterion(ddp(x), y)
                if args.loss == "sum-per-sample":
                    loss = loss / x.size(0)
                loss = (loss + L2 * model[2].weight.pow(2).sum()) / args.accum
                (loss if scaler is None else scaler.scale(loss)).backward()
            if last_micro_step:
                if scaler is not None:
                    scaler.unscale_(optimizer)  # the clip reads the gradients the step takes
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), 5.0)
                if scaler is None:
                    optimizer.step()
                else:
                    scaler.step(optimizer)
                    scaler.update()
                optimizer.zero_grad()
        _harness.say(rank, f"epoch {epoch} loss {loss.item() * args.accum:.6f}")
    _harness.say(rank, f"final {_harness.checksum(model)}")


if __name__ == "__main__":
    parser = _harness.parser(__doc__.splitlines()[0])
    parser.add_argument("--loss", choices=("mean", "sum-per-sample", "sum"), default="mean")
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--grad-scaler", action="store_true", help="scale the loss by torch.amp.GradScaler")
    _harness.run(train, parser.parse_args())
