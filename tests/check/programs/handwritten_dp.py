"""Data parallelism written by hand, as some trainers do without a DDP wrapper: every rank builds the same model from
one seed, and the optimizer averages the gradients itself inside its step, then updates. ``--reduce``:

- ``avg``: each .grad all-reduced in place and divided by the world size;
- ``avg-buffer``: the average taken into a buffer of the optimizer's own, each rank's .grad left as it was (the way
  optimizers that reduce-scatter into their own shards leave it);
- ``sum`` (planted): all-reduced in place without dividing by the world size.

    torchrun --nproc_per_node 2 handwritten_dp.py --batch-size 8 [--reduce sum]
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class DistributedAdamW(torch.optim.AdamW):
    """AdamW whose step first reduces every gradient over the ranks: the average, or (planted) the sum."""

    def __init__(self, params, reduce="avg", **kwargs):
        super().__init__(params, **kwargs)
        self.reduce = reduce

    @torch.no_grad()
    def step(self, closure=None):
        world = dist.get_world_size()
        local = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if self.reduce == "avg-buffer":
                    local[p], p.grad = p.grad, p.grad.clone()
                dist.all_reduce(p.grad)
                if self.reduce != "sum":
                    p.grad.div_(world)
        loss = super().step(closure)
        for p, grad in local.items():
            p.grad = grad  # this rank's own gradient again: the average lived in the optimizer's buffer only
        return loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--reduce", choices=("avg", "avg-buffer", "sum"), default="avg")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 1))
    optimizer = DistributedAdamW(model.parameters(), reduce=args.reduce, lr=1e-2, eps=1e-3)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1024, 16, generator=g)
    data = TensorDataset(x, x[:, :4].sum(1, keepdim=True) + 0.1 * torch.randn(1024, 1, generator=g))
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    for step, (inputs, targets) in enumerate(loader):
        if step == args.steps:
            break
        loss = F.mse_loss(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    if dist.get_rank() == 0:
        print(f"final loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
