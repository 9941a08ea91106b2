"""A CLIP-style contrastive model as such trainers write it: two towers, a learned logit scale, the features of every
rank gathered so each rank's loss sees the global batch's N×N logits. ``--gather`` says how:

- ``autograd`` (correct): torch.distributed.nn's all_gather, whose backward sums every rank's gradient for the
  features into the rank that made them;
- ``no-grad``: all_gather without autograd, this rank's own slice put back with its graph (the towers then get 1/W of
  the gradient: each rank's loss reaches only its own features);
- ``local``: each rank's rows of logits against the gathered columns, all detached but its own.

    torchrun --nproc_per_node 2 clip.py --batch-size 8 [--gather no-grad]
"""

import argparse

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--gather", choices=("autograd", "no-grad", "local"), default="autograd")
    return parser.parse_args()


class Clip(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
        self.text = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, image, caption):
        return (F.normalize(self.visual(image), dim=-1), F.normalize(self.text(caption), dim=-1),
                self.logit_scale.exp())


def gather(features, how):
    if how == "autograd":
        return torch.cat(dist_nn.all_gather(features), 0)
    pieces = [torch.zeros_like(features) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, features.detach())
    pieces[dist.get_rank()] = features
    return torch.cat(pieces, 0)


def contrastive_loss(image, text, scale, how):
    rank, local = dist.get_rank(), image.shape[0]
    all_image, all_text = gather(image, how), gather(text, how)
    if how == "local":
        labels = torch.arange(local) + rank * local
        logits_image = scale * image @ all_text.T
        logits_text = scale * text @ all_image.T
    else:
        labels = torch.arange(all_image.shape[0])
        logits_image = scale * all_image @ all_text.T
        logits_text = logits_image.T
    return (F.cross_entropy(logits_image, labels) + F.cross_entropy(logits_text, labels)) / 2


def main():
    args = parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(Clip())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    pairs = TensorDataset(torch.randn(256, 24, generator=g), torch.randn(256, 12, generator=g))
    sampler = DistributedSampler(pairs, seed=0)
    loader = DataLoader(pairs, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    for step, (image, caption) in enumerate(loader):
        if step == args.steps:
            break
        loss = contrastive_loss(*model(image, caption), args.gather)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if dist.get_rank() == 0 and step % 5 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
