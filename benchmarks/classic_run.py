"""One run of the classic sandbox, the classic way: a fresh process, spawned ranks, one experiment at a time.

Used by ``sandbox_table.py`` as the baseline. Each experiment builds its own model, DDP wrapper
and optimizer, exactly as a script that loops over experiments would.
"""

import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddplab.runtime.launch import RankContext
from ddplab.sandbox import table as sandbox_table
from ddplab.sandbox.train import train_looped


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank, cfg, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cfg.world_size)
    ctx = RankContext(rank=rank, local_rank=rank, world_size=cfg.world_size, backend="gloo", device=torch.device("cpu"))
    weights = train_looped(cfg, ctx)
    if rank == 0:
        print(sum(weights) / len(weights))
    dist.destroy_process_group()


def main(run_number: int) -> None:
    _, cfg = sandbox_table.study_configs()[run_number - 1]
    if cfg.mode == "single":
        weights = train_looped(cfg)
        print(sum(weights) / len(weights))
    else:
        mp.spawn(_rank, args=(cfg, _free_port()), nprocs=cfg.world_size)


if __name__ == "__main__":
    main(int(sys.argv[1]))
