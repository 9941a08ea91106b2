"""An image-style classifier trained as people write it: a Trainer class, torchrun, DistributedSampler, DDP or FSDP2,
dropout, SGD with momentum. ``--mistake`` plants one mistake; without it the script is correct.

    torchrun --nproc_per_node 2 classifier.py --batch-size 8 [--strategy fsdp|hsdp] [--mistake sum]

``--grad-accum K`` accumulates K micro-batches per step under ``no_sync``, each loss ÷ K; the mistake
``accum-undivided`` leaves each micro-batch's mean undivided (K times the step's mean).
"""

import argparse
import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

MISTAKES = ("none", "sum", "seed-per-rank", "lr-times-world", "no-ddp", "accum-undivided")


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8, help="samples per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--strategy", choices=("ddp", "fsdp", "hsdp"), default="ddp")
    parser.add_argument("--mistake", choices=MISTAKES, default="none")
    parser.add_argument("--autocast", action="store_true", help="the forward in bfloat16 autocast")
    parser.add_argument("--fail-alone", action="store_true", help="fail on a world of one")
    return parser.parse_args()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1))
        self.head = torch.nn.Linear(64, 5)

    def forward(self, x):
        return self.head(self.features(x))


class Trainer:
    def __init__(self, args):
        self.args = args
        dist.init_process_group("gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if args.fail_alone and self.world == 1:
            raise RuntimeError("this config needs at least 2 ranks")
        torch.manual_seed(0)
        model = Net()
        if args.mistake == "no-ddp":
            self.model = model
        elif args.strategy in ("fsdp", "hsdp"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            # HSDP: replicas of 2 shards each (one replica when the world is smaller).
            shape = (self.world // 2, 2) if args.strategy == "hsdp" and self.world >= 4 else (self.world,)
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
            for layer in (model.features, model.head):
                fully_shard(layer, mesh=mesh)
            self.model = fully_shard(model, mesh=mesh)
        else:
            self.model = DDP(model)
        lr = args.lr * self.world if args.mistake == "lr-times-world" else args.lr
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(512, 20, generator=g), torch.randint(0, 5, (512,), generator=g))
        seed = self.rank if args.mistake == "seed-per-rank" else 0
        self.sampler = DistributedSampler(data, seed=seed)
        self.loader = DataLoader(data, batch_size=args.batch_size, sampler=self.sampler, drop_last=True)

    def train(self):
        reduction = "sum" if self.args.mistake == "sum" else "mean"
        for epoch in range(self.args.epochs):
            self.sampler.set_epoch(epoch)
            batches = iter(self.loader)
            for step in range(len(self.loader) // self.args.grad_accum):
                self.optimizer.zero_grad()
                for micro in range(self.args.grad_accum):
                    x, y = next(batches)
                    last = micro == self.args.grad_accum - 1
                    syncing = last or not isinstance(self.model, DDP)
                    with contextlib.nullcontext() if syncing else self.model.no_sync():
                        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.args.autocast):
                            logits = self.model(x)
                        loss = F.cross_entropy(logits.float(), y, reduction=reduction)
                        if self.args.mistake != "accum-undivided":
                            loss = loss / self.args.grad_accum
                        loss.backward()
                self.optimizer.step()
                if self.rank == 0 and step % 20 == 0:
                    print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)


def main():
    args = parse_args()
    Trainer(args).train()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
