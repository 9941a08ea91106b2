"""Noiseless linear regression trained the way a project's train.py does: DistributedSampler, DataLoader,
DDP or FSDP2 (fully_shard), no_sync accumulation, an SGD loop that prints its losses.

y = x·w* with Gaussian x and the weights at 0 (lr 0 keeps them there): the per-sample gradient is
−2x(x·w*), whose tr Σ / |G|² is D + 1 (tests/specs/noiseless_regression.py derives it).

    torchrun --nproc_per_node 2 regression.py [--strategy fsdp] [--accumulation 2]
    python regression.py --launcher fork|spawn
    python regression.py --launcher none --strategy none --accumulation 4    # one process
"""

import argparse
import contextlib
import gc
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

D, SAMPLES = 15, 60_000


def dataset():
    generator = torch.Generator().manual_seed(4321)
    x = torch.randn(SAMPLES, D, generator=generator)
    w_star = torch.randn(D, 1, generator=generator)
    return TensorDataset(x, x @ w_star)


def build_model(strategy: str, world_size: int, bucket_view: bool = False):
    model = torch.nn.Sequential(torch.nn.Linear(D, 1, bias=False))
    torch.nn.init.zeros_(model[0].weight)
    if strategy == "none":
        return model
    if strategy == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if strategy == "fsdp":
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
    else:
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    fully_shard(model[0], mesh=mesh)
    return fully_shard(model, mesh=mesh)


def no_sync(model, strategy: str):
    if strategy == "none":
        return contextlib.nullcontext()  # one process: nothing to synchronise
    if strategy == "ddp":
        return model.no_sync()

    @contextlib.contextmanager
    def fsdp_no_sync():
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    return fsdp_no_sync()


def train(rank: int, world_size: int, args) -> None:
    data = dataset()
    model = build_model(args.strategy, world_size, args.bucket_view)
    sampler = DistributedSampler(data, shuffle=True, seed=0) if world_size > 1 else \
        torch.utils.data.RandomSampler(data, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9 if args.lr else 0.0)
    losses = open(args.losses, "w") if args.losses and rank == 0 else None
    step, micro, epoch = 0, 0, 0
    while step < args.steps:
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        for x, y in loader:
            last = (micro + 1) % args.accumulation == 0
            with contextlib.nullcontext() if last else no_sync(model, args.strategy):
                loss = torch.nn.functional.mse_loss(model(x), y) / args.accumulation
                loss.backward()
            micro += 1
            if losses is not None:
                print(f"step {step} micro {micro} loss {loss.item()!r}", file=losses, flush=True)
            if not last:
                continue
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            while step == args.stall_after:
                time.sleep(60)  # asleep, not computing, until a deadline or a signal ends the job
            if step == args.steps:
                break
        epoch += 1
    if rank == 0:
        print(f"trained {step} steps", flush=True)
    if losses is not None:
        weight = {"ddp": lambda: model.module[0].weight, "none": lambda: model[0].weight}.get(
            args.strategy, lambda: model[0].weight.to_local())()
        print("weights (this rank's)", weight.detach().reshape(-1).tolist(), file=losses)
        losses.close()


def rank_main(rank: int, world_size: int, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        train(rank, world_size, args)
    finally:
        # The DDP wrapper sits in reference cycles: collected before the group goes, or its gloo threads outlive it.
        gc.collect()
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--launcher", choices=("torchrun", "spawn", "fork", "none"), default="torchrun",
                        help="none: one process, no process group (with --strategy none)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--strategy", choices=("ddp", "fsdp", "hsdp", "none"), default="ddp")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=0.0)
    parser.add_argument("--losses", help="rank 0 writes each micro-step's loss and the final weights here")
    parser.add_argument("--bucket-view", action="store_true", help="DDP's gradient_as_bucket_view=True")
    parser.add_argument("--stall-after", type=int, help="after this many optimizer steps each rank sleeps")
    parser.add_argument("--exit-code", type=int, default=0, help="exit with this code after training")
    args = parser.parse_args()
    if args.launcher == "none":
        torch.set_num_threads(1)
        train(0, 1, args)
    elif args.launcher == "torchrun":
        rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
        mp.start_processes(rank_main, args=(args.world_size, args), nprocs=args.world_size,
                           start_method=args.launcher)
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())
