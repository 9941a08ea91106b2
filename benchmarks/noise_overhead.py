"""Step time of plain DDP vs DDP + GradientNoiseScale (and AdaScale on it): the overhead of measuring and adapting.

    python benchmarks/noise_overhead.py [--rounds 80] [--steps-per-round 1] \
[--out benchmarks/results/noise_overhead.json]
    python benchmarks/noise_overhead.py --strategy fsdp --repeats 3    # FSDP2 (fully_shard) instead of DDP

Two ranks (gloo on CPU, or NCCL with a GPU per rank), a 10.5M-parameter MLP, per-rank batch 64.
The variants are separate wrappers over equal models in one launch; they take turns step by
step, so drift in the machine's speed falls on all of them alike. Reported: the median step
time of each, and its overhead over the plain loop; with ``--repeats N``, N launches and the median
of their overheads.
"""

import argparse
import json
import os
import platform
import random
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ddplab.adapt.adascale import AdaScale
from ddplab.noise.scale import GradientNoiseScale
from ddplab.runtime import strategies
from ddplab.runtime.launch import LaunchConfig, launch

# name → None (plain DDP), ("hook",) (torch's own Python allreduce hook: what any Python comm hook costs),
# (every, via) for GradientNoiseScale, or (every, via, "adascale") for AdaScale driven by it at S = 2.
VARIANTS = {"plain DDP": None, "torch's Python allreduce hook": ("hook",),
            "noise scale (default), every step": (1, "auto"), "noise scale (default), every 4th step": (4, "auto"),
            "noise scale via comm hook, every step": (1, "comm_hook"),
            "AdaScale, noise every step": (1, "auto", "adascale"),
            "AdaScale, noise every 4th step": (4, "auto", "adascale")}
# Under FSDP2 (--strategy fsdp): the plain loop, and the noise scale at its default (every 4th step) and every step.
FSDP_VARIANTS = {"plain FSDP2": None, "noise scale (default), every 4th step": (4, "auto"),
                 "noise scale (default), every step": (1, "auto")}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, 4608), torch.nn.ReLU(), torch.nn.Linear(4608, 1024),
                               torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))


def _wrap(ctx, strategy: str):
    if strategy == "fsdp":
        return strategies.get("fsdp").wrap(_model().to(ctx.device), ctx)
    return DistributedDataParallel(_model().to(ctx.device), device_ids=ctx.device_ids)


def _bench(ctx, rounds: int, steps_per_round: int, batch: int, strategy: str = "ddp"):
    runs = {}
    for name, every in (FSDP_VARIANTS if strategy == "fsdp" else VARIANTS).items():
        ddp = _wrap(ctx, strategy)
        gns = None
        if every == ("hook",):
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        elif every:
            gns = GradientNoiseScale(ddp, per_device_batch_size=batch, every=every[0], via=every[1])
        optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-4)
        if every and every[-1] == "adascale":
            # The reference batch is one rank's: the global batch is S = world size times it.
            AdaScale(optimizer, gns, reference_batch_size=batch)
        runs[name] = (ddp, gns, optimizer, [])
    generator = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(batch, 1024, generator=generator).to(ctx.device)
    y = torch.randint(0, 10, (batch,), generator=generator).to(ctx.device)
    order = random.Random(0)  # the same shuffled order on every rank
    names = list(runs)
    for round_ in range(rounds + 1):
        order.shuffle(names)
        for name in names:
            ddp, gns, optimizer, times = runs[name]
            for _ in range(steps_per_round):
                _sync(ctx)
                wall, cpu = time.perf_counter(), time.process_time()
                optimizer.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
                if gns:
                    gns.step()
                optimizer.step()
                _sync(ctx)
                if round_ > 0:  # round 0 warms up
                    times.append((time.perf_counter() - wall, time.process_time() - cpu))
    params = sum(p.numel() for p in _model().parameters())
    return {name: run[3] for name, run in runs.items()}, params


def _sync(ctx):
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--steps-per-round", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--repeats", type=int, default=1, help="launches; the overheads reported are their median")
    parser.add_argument("--out", help="default benchmarks/results/noise_overhead.json (noise_overhead_fsdp.json)")
    args = parser.parse_args()
    name = "noise_overhead.json" if args.strategy == "ddp" else f"noise_overhead_{args.strategy}.json"
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)
    repeats = [_one_launch(args) for _ in range(args.repeats)]
    record = {"machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, torch {torch.__version__}",
              "backend": "nccl" if torch.cuda.device_count() >= 2 else "gloo", "strategy": args.strategy,
              "world_size": 2, "per_device_batch_size": args.batch_size, "parameters": repeats[0][1],
              "steps_timed_per_variant": len(next(iter(repeats[0][0].values()))), "repeats": [], "variants": {}}
    for times, _ in repeats:
        record["repeats"].append(_medians(times))
    for variant in record["repeats"][0]:
        rows = [repeat[variant] for repeat in record["repeats"]]
        record["variants"][variant] = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    if args.repeats > 1:
        print(f"median over {args.repeats} launches:")
        for variant, row in record["variants"].items():
            _print(variant, row)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(record, fh, indent=2)


def _one_launch(args):
    return launch(_bench, LaunchConfig(world_size=2, deadline_s=3000), args.rounds, args.steps_per_round,
                  args.batch_size, args.strategy)[0]


def _medians(times: dict) -> dict:
    """Per variant: median wall and rank-0 CPU time per step, and their overheads over the first (plain) variant."""
    plain = next(iter(times.values()))
    base_wall = statistics.median(w for w, _ in plain)
    base_cpu = statistics.median(c for _, c in plain)
    out = {}
    for name, values in times.items():
        wall, cpu = statistics.median(w for w, _ in values), statistics.median(c for _, c in values)
        out[name] = {"median_step_ms": 1000 * wall, "overhead_percent": 100 * (wall / base_wall - 1),
                     "median_cpu_ms": 1000 * cpu, "cpu_overhead_percent": 100 * (cpu / base_cpu - 1)}
        _print(name, out[name])
    return out


def _print(name: str, row: dict) -> None:
    print(f"{name:38} {row['median_step_ms']:7.1f} ms/step ({row['overhead_percent']:+5.2f}%)   "
          f"rank-0 CPU {row['median_cpu_ms']:7.1f} ms/step ({row['cpu_overhead_percent']:+5.2f}%)")


if __name__ == "__main__":
    main()
