"""What every DeepSpeed corpus script shares: one gloo group, the engine's config, a deterministic last line.

Run a script as

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 2 SCRIPT.py --stage 2 [flags]

(or under DeepSpeed's own launcher: `deepspeed --num_gpus 2 SCRIPT.py ...`, which on a CPU machine starts 2 ranks too).
DeepSpeed finds no GPU and picks its CPU accelerator by itself (DS_ACCELERATOR=cpu only silences its warning); the
first `init_distributed` of a fresh machine compiles a small shared-memory op (deepspeed_shm_comm, ~2.5 minutes,
cached under ~/.cache/torch_extensions). Everything trains in fp32: no fp16/bf16 block in the config.

Only what a script prints to stdout is its output (rank 0's per-step losses and the parameter checksum); it must not
depend on being audited.
"""

import argparse
import json
import os
import sys

import deepspeed
import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))


def parser(description: str) -> argparse.ArgumentParser:
    """The flags every DeepSpeed corpus script takes: the config file and what overrides it."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--deepspeed_config", "--config", dest="config", default=os.path.join(HERE, "ds_config.json"),
                        help="a DeepSpeed config JSON (train_micro_batch_size_per_gpu, gradient_accumulation_steps, "
                             "zero_optimization)")
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=None, help="ZeRO stage (overrides the file)")
    parser.add_argument("--accumulation", type=int, default=None,
                        help="gradient_accumulation_steps (overrides the file)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="train_micro_batch_size_per_gpu (overrides the file)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by DeepSpeed's launcher; unused")
    return parser


def config(args) -> dict:
    """The config file with the command line's overrides: what deepspeed.initialize is given."""
    with open(args.config) as fh:
        cfg = json.load(fh)
    if args.stage is not None:
        cfg.setdefault("zero_optimization", {})["stage"] = args.stage
    if args.accumulation is not None:
        cfg["gradient_accumulation_steps"] = args.accumulation
        cfg.pop("train_batch_size", None)  # re-derived by DeepSpeed from the other two
    if args.micro_batch is not None:
        cfg["train_micro_batch_size_per_gpu"] = args.micro_batch
        cfg.pop("train_batch_size", None)
    return cfg


def start() -> tuple[int, int]:
    """One gloo process group, as DeepSpeed starts it on CPU: (rank, world size)."""
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    return dist.get_rank(), dist.get_world_size()


def finish() -> None:
    dist.barrier()
    dist.destroy_process_group()


def checksum(engine) -> str:
    """Sum and sum of squares of every parameter (gathered from its shards under ZeRO-3; a collective), as text."""
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1).double() for p in params])
            line = f"params {flat.sum().item():.6f} {flat.pow(2).sum().item():.6f}"
    return line


def emit(line: str) -> None:
    """One line in one write, flushed: lines from several ranks never interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def say(rank: int, line: str) -> None:
    """Print on rank 0 only."""
    if rank == 0:
        emit(line)
