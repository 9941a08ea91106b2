"""A torchrun script shaped like the Hugging Face examples: it reads LOCAL_RANK and goes distributed where it can.

Run it only under torchrun (`torchrun --nproc_per_node 2 gpu_only_ddp.py`). Each rank logs its setting the way the
examples do ("distributed training: True/False"), trains a small regressor on its DistributedSampler shard for
`--steps` optimizer steps, and prints its final loss.

`--distributed-when any` (correct): every launched process joins a gloo process group and wraps the model in DDP.

Mistakes: `--distributed-when cuda` joins a group and wraps the model only when CUDA is there, as code written for
GPUs does, so on a CPU machine each process trains alone without any process group; `--distributed-when
cuda-model` joins the group everywhere (its sampler shards the data) but wraps the model in DDP only on GPUs, so
the group is never used (NOT_DISTRIBUTED both ways).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

FEATURES, SAMPLES, BATCH = 8, 512, 16


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--distributed-when", choices=("any", "cuda", "cuda-model"), default="any")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    local_rank = int(os.environ.get("LOCAL_RANK", -1))
    joins = local_rank != -1 and (args.distributed_when != "cuda" or torch.cuda.is_available())
    if joins:
        dist.init_process_group("gloo")
    wraps = joins and (args.distributed_when == "any" or torch.cuda.is_available())
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if joins else (0, 1)
    # torchrun starts ranks with python -u: print's text and newline are two writes, and two ranks' lines could
    # splice mid-line, so each line goes out in one write.
    print(f"Process rank: {local_rank}, distributed training: {wraps}\n", end="", flush=True)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    data = TensorDataset(x, torch.tanh(x[:, :2]).sum(dim=1, keepdim=True))
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    if wraps:
        model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    try:
        for _, (inputs, targets) in zip(range(args.steps), loader):
            loss = F.mse_loss(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        print(f"Process rank: {local_rank}, final loss {loss.item():.6f}\n", end="", flush=True)
    finally:
        if joins:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
