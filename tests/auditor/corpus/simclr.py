"""SimCLR-style contrastive pretraining under DDP: NT-Xent over features gathered from every rank, and its gradient.

8×8 single-channel images of 6 prototype shapes; each sample gives two augmented views (a random shift, a random
horizontal flip, pixel noise), drawn from a generator seeded by the sample's index and the epoch, so a view does not
depend on which rank loads it. An encoder (a small conv net) and a projection head under DDP embed both views in
one forward; the L2-normalised projections of every rank are all-gathered, and every rank computes the NT-Xent loss
over all 2·B·W rows: the cosine similarities ÷ a temperature, the row's own similarity masked out, the other view
of its sample as the target, F.cross_entropy's mean over the 2·B·W rows. A DistributedSampler (set_epoch every
epoch); SGD with momentum; 6 steps, each reporting the contrastive accuracy too: how often a row's most similar
other row is its partner view.

Every rank computes the same global loss, so a gather whose backward sums the gradient from every rank's copy of
the loss gives each rank W times the gradient of its own rows; DDP's average then leaves the one-process gradient.

  --gather autograd           correct: torch.distributed.nn.functional.all_gather (its backward sums over the ranks)
  --gather slice-times-world  correct: the custom GatherLayer below, the loss × world size
  --batch-size B              samples per rank (default 8); W=1 with 2B is the same global batch as W=2

Mistake:

  --gather slice    a custom GatherLayer(torch.autograd.Function): forward dist.all_gather, backward only this
                    rank's slice of the incoming gradient, without all-reduce. Each rank keeps the gradient of its
                    own copy of the loss: DDP's average makes the gradient 1/W of the one-process gradient
                    (GATHERED_LOSS_WITHOUT_WORLD_SIZE)

Rank 0 prints the gradient norm after the first backward (DDP's averaged .grad), each step's loss and the
contrastive accuracy, and a checksum of the parameters.
"""

import _harness
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

SIZE, SHAPES, FEATURES, PROJECTION = 8, 6, 32, 16
STEPS, LR, TEMPERATURE, SAMPLES = 6, 0.1, 0.5, 96


class TwoViews(Dataset):
    """Noisy copies of a few prototypes; two augmented views per sample, seeded by (index, epoch)."""

    def __init__(self, count, seed):
        generator = torch.Generator().manual_seed(seed)
        prototypes = (torch.rand(SHAPES, SIZE, SIZE, generator=generator) > 0.6).float()
        self.labels = torch.randint(SHAPES, (count,), generator=generator)
        self.images = prototypes[self.labels] + 0.1 * torch.randn(count, SIZE, SIZE, generator=generator)
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.images)

    def augment(self, image, generator):
        shift = torch.randint(-1, 2, (2,), generator=generator).tolist()
        view = torch.roll(image, shifts=shift, dims=(0, 1))
        if torch.rand((), generator=generator) < 0.5:
            view = view.flip(-1)
        return (view + 0.2 * torch.randn(view.shape, generator=generator)).unsqueeze(0)

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(1_000 * self.epoch + index)
        image = self.images[index]
        return self.augment(image, generator), self.augment(image, generator)


class SimCLRNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2, padding=1),
                                     nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, FEATURES))
        self.projector = nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.ReLU(), nn.Linear(FEATURES, PROJECTION))

    def forward(self, views):
        return F.normalize(self.projector(self.encoder(views)), dim=1)


class GatherLayer(torch.autograd.Function):
    """All-gather along the batch; backward hands this rank the gradient of its own rows, no reduction."""

    @staticmethod
    def forward(ctx, local):
        ctx.rank, ctx.rows = dist.get_rank(), local.shape[0]
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, local.contiguous())
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows]


def gather_rows(z, how):
    if how == "autograd":
        return torch.cat(dist_fn.all_gather(z))
    return GatherLayer.apply(z)


def nt_xent(z1, z2, temperature):
    """NT-Xent over 2N rows: row i's positive is its other view, every other row a negative."""
    n = z1.shape[0]
    z = torch.cat([z1, z2])
    logits = z @ z.t() / temperature
    logits = logits.masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return F.cross_entropy(logits, targets), (logits.argmax(dim=1) == targets).float().mean()


def train(rank, world_size, args):
    dataset = TwoViews(SAMPLES, seed=0)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    torch.manual_seed(0)
    model = DDP(SimCLRNet())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=1e-4)

    step, epoch = 0, 0
    while step < STEPS:
        sampler.set_epoch(epoch)
        dataset.set_epoch(epoch)
        for view1, view2 in loader:
            z1, z2 = model(torch.cat([view1, view2])).chunk(2)
            loss, accuracy = nt_xent(gather_rows(z1, args.gather), gather_rows(z2, args.gather), TEMPERATURE)
            if args.gather == "slice-times-world":
                loss = loss * world_size  # the slice gather keeps one rank's share: scale back before DDP's mean
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if step == 0:
                norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters()))
                _harness.say(rank, f"step 0 grad norm {norm.item():.9g}")
            optimizer.step()
            step += 1
            shown = loss.item() / (world_size if args.gather == "slice-times-world" else 1)
            _harness.say(rank, f"step {step} loss {shown:.6f} contrastive accuracy {accuracy.item():.4f}")
            if step == STEPS:
                break
        epoch += 1
    _harness.say(rank, _harness.checksum(model.module))


if __name__ == "__main__":
    parser = _harness.parser(__doc__.splitlines()[0])
    parser.add_argument("--gather", choices=("autograd", "slice", "slice-times-world"), default="autograd")
    parser.add_argument("--batch-size", type=int, default=8)
    _harness.run(train, parser.parse_args())
