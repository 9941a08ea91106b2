"""Step time of plain DDP vs DDP + GradientNoiseScale: the overhead of measuring the noise scale.

    python benchmarks/noise_overhead.py [--rounds 8] [--steps-per-round 10] [--out benchmarks/results/noise_overhead.json]

Two ranks (gloo on CPU, or NCCL with a GPU per rank), a 10.5M-parameter MLP, per-rank batch 64.
The variants (plain DDP, measuring every step, measuring every 4th step) are separate DDP
wrappers over equal models in one launch; they take turns, round by round, so drift in the
machine's speed falls on all of them alike. Reported: the median step time of each.
"""

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddplab.launch import LaunchConfig, launch
from ddplab.noise_scale import GradientNoiseScale

VARIANTS = {"plain DDP": None, "noise scale, every step": 1, "noise scale, every 4th step": 4}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024),
                               torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))


def _bench(ctx, rounds: int, steps_per_round: int, batch: int):
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    runs = {}
    for name, every in VARIANTS.items():
        ddp = DistributedDataParallel(_model().to(ctx.device), device_ids=device_ids)
        gns = GradientNoiseScale(ddp, per_device_batch_size=batch, every=every) if every else None
        runs[name] = (ddp, gns, torch.optim.SGD(ddp.parameters(), lr=1e-4), [])
    generator = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(batch, 1024, generator=generator).to(ctx.device)
    y = torch.randint(0, 10, (batch,), generator=generator).to(ctx.device)
    for round_ in range(rounds + 1):
        for name, (ddp, gns, optimizer, times) in runs.items():
            for _ in range(steps_per_round):
                _sync(ctx)
                started = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
                if gns:
                    gns.step()
                optimizer.step()
                _sync(ctx)
                if round_ > 0:  # round 0 warms up
                    times.append(time.perf_counter() - started)
    params = sum(p.numel() for p in _model().parameters())
    return {name: run[3] for name, run in runs.items()}, params


def _sync(ctx):
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps-per-round", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "noise_overhead.json"))
    args = parser.parse_args()
    times, params = launch(_bench, LaunchConfig(world_size=2, deadline_s=3000), args.rounds, args.steps_per_round,
                           args.batch_size)[0]
    baseline = statistics.median(times["plain DDP"])
    record = {"machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, torch {torch.__version__}",
              "backend": "nccl" if torch.cuda.device_count() >= 2 else "gloo", "world_size": 2,
              "per_device_batch_size": args.batch_size, "parameters": params,
              "steps_timed_per_variant": len(times["plain DDP"]), "median_step_seconds": {}, "overhead_percent": {}}
    for name, values in times.items():
        median = statistics.median(values)
        record["median_step_seconds"][name] = median
        record["overhead_percent"][name] = 100 * (median / baseline - 1)
        print(f"{name:30} {median * 1000:8.1f} ms/step  overhead {record['overhead_percent'][name]:+.2f}%")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(record, fh, indent=2)


if __name__ == "__main__":
    main()
