"""What every corpus script shares: starting its ranks three ways, one gloo group, a deterministic last line.

Each script is a complete DDP training program in a shape real projects use. Run it as

    torchrun --standalone --nproc_per_node 2 SCRIPT.py [flags]
    python SCRIPT.py --launcher spawn [flags]   # torch.multiprocessing.spawn
    python SCRIPT.py --launcher fork [flags]    # start_processes(start_method="fork"): ranks leave by os._exit

Only what a script prints to stdout is its output; it must not depend on the launcher or on being audited.
"""

import argparse
import gc
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the launcher flags every corpus script takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--launcher", choices=("torchrun", "spawn", "fork"), default="torchrun")
    parser.add_argument("--world-size", type=int, default=2, help="ranks to start (spawn and fork only)")
    return parser


def run(train, args: argparse.Namespace) -> None:
    """Run ``train(rank, world_size, args)`` on every rank, however the ranks are started."""
    if args.launcher == "torchrun":
        _rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), train, args)
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    if args.launcher == "spawn":
        mp.spawn(_rank_main, args=(args.world_size, train, args), nprocs=args.world_size)
    else:
        # DDP's constructor imports torch._dynamo (~1.6 s of CPU): once here, not once per forked rank.
        import torch._dynamo  # noqa: F401

        mp.start_processes(_rank_main, args=(args.world_size, train, args), nprocs=args.world_size,
                           start_method="fork")


def _rank_main(rank: int, world_size: int, train, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        train(rank, world_size, args)
    finally:
        # A Reducer holding the last reference to the group can hang the process at exit.
        gc.collect()
        dist.destroy_process_group()


def checksum(module: torch.nn.Module) -> str:
    """Sum and sum of squares of every parameter, as text: equal runs print equal lines."""
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1).double() for p in module.parameters()])
    return f"params {flat.sum().item():.6f} {flat.pow(2).sum().item():.6f}"


def emit(line: str) -> None:
    """One line in one write, flushed: lines from several ranks never interleave, and os._exit loses none."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def say(rank: int, line: str) -> None:
    """Print on rank 0 only."""
    if rank == 0:
        emit(line)
