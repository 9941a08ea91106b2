"""A DDP training loop on one CUDA device, for ``ddplab audit``: two gloo ranks share the GPU, started by mp.spawn.

    python cuda_ddp.py --out DEVICE_FILE [--bypass] [--device cpu]

NCCL wants a GPU per rank, gloo does not: two ranks on one GPU give the auditor two ranks of CUDA tensors to
compare. ``--bypass`` forwards through the inner module (the classic mistake: no all-reduce, ranks drift
apart). ``--device cpu`` runs the same loop without a GPU. Rank 0 writes where its parameters ended up to DEVICE_FILE.
"""

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

WORLD_SIZE = 2


def train(rank: int, bypass: bool, out: str, device: str) -> None:
    on_gpu = device == "cuda"
    if on_gpu:
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(256, 8, generator=generator)
        data = TensorDataset(x, x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(256, 1, generator=generator))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to(device)
        ddp = DistributedDataParallel(model, device_ids=[0] if on_gpu else None)
        forward = ddp.module if bypass else ddp
        sampler = DistributedSampler(data, shuffle=True)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for inputs, targets in DataLoader(data, batch_size=16, sampler=sampler):
                optimizer.zero_grad()
                F.mse_loss(forward(inputs.to(device)), targets.to(device)).backward()
                optimizer.step()
        if rank == 0:
            with open(out, "w") as fh:
                fh.write(str(next(model.parameters()).device))
        del ddp, forward, optimizer
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--bypass", action="store_true")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    mp.start_processes(train, args=(args.bypass, args.out, args.device), nprocs=WORLD_SIZE, start_method="spawn")


if __name__ == "__main__":
    main()
