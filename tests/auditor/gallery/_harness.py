"""What every gallery script shares: data, model, and starting ranks by torchrun or mp.spawn.

Each script is a small, complete DDP training loop with one mistake (or none, in correct.py).
Run it as `torchrun --nproc_per_node 2 SCRIPT.py`, `python SCRIPT.py --launcher spawn` or
`python SCRIPT.py --launcher fork` (torch.multiprocessing.start_processes with fork).
"""

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SAMPLES, FEATURES = 256, 8


def dataset():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def model(batchnorm: bool = False):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(FEATURES, 16)] + ([torch.nn.BatchNorm1d(16)] if batchnorm else []) + \
             [torch.nn.ReLU(), torch.nn.Linear(16, 1)]
    return torch.nn.Sequential(*layers)


def main(train):
    """Run ``train(rank, world_size)`` on every rank, however the ranks were started."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--launcher", choices=("torchrun", "spawn", "fork"), default="torchrun")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    if args.launcher == "torchrun":
        _rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), train)
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    if args.launcher == "fork":
        # DDP's constructor imports torch._dynamo (~1.6 s of CPU): once here, not once per forked rank.
        import torch._dynamo  # noqa: F401
    mp.start_processes(_rank_main, args=(args.world_size, train), nprocs=args.world_size, start_method=args.launcher)


def _rank_main(rank, world_size, train):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        train(rank, world_size)
        # A rank that exits the instant its last collective returns can abort in gloo: meet the peers first.
        dist.barrier()
    finally:
        dist.destroy_process_group()
