"""ddplab study's vectorized engine on a CUDA device, timed against that device's own matmul floor.

study_speed.py's floor, on the GPU: the group's FLOPs per step (counted by torch.utils.flop_counter on one real
step, as there) over the sustained float32 FLOP/s of a large matrix product on the device, measured here with
the clock read only once the device has finished. ``ratio_to_floor`` is a step's time over that floor: 1 would
be every step running at matmul peak, and below 1 is impossible, so a ratio under 1 means a clock that did not
wait for the GPU. Each row gives it for this script's synchronized timing and for the engine's own
(``engine_s_per_step``: what ``--engine fastest`` compares), and the largest parameter difference between the
runs trained 10 steps on the GPU and on the CPU (None with dropout, whose masks differ between devices).

    PYTHONPATH=src python benchmarks/study_speed_cuda.py [--workload digits|mnist1d|charlm] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import study_speed
import torch

from ddplab.study import workloads
from ddplab.study.config import StudyConfig, Target
from ddplab.study.engines import vmap as engine
from ddplab.study.rules import sweep
from ddplab.study.runs import grid_group


def synchronized(fn, device: torch.device):
    """``fn`` followed by a wait for every kernel it queued on ``device``: what a clock must time."""
    def run_and_wait():
        fn()
        torch.cuda.synchronize(device)
    return run_and_wait


def matmul_flops_per_s(device: torch.device, size: int = 4096, repeats: int = 5) -> float:
    """Sustained float32 FLOP/s of a ``size``² matrix product on ``device``: the best of ``repeats``."""
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    synchronized(lambda: a @ b, device)()
    best = study_speed.measure(synchronized(lambda: [a @ b for _ in range(4)], device), repeats)
    return 4 * 2 * size ** 3 / best


def step_s(workload, config, global_batch: int, runs, device: torch.device, steps: int, repeats: int) -> float:
    """Seconds per vectorized step of every run on ``device``, clocked after the device finished (best of
    ``repeats`` stretches of ``steps``, after a warm-up step)."""
    group = engine.Group(workload, config, grid_group(config, global_batch, runs), device=device)
    done = iter(range(1, 1 + steps * repeats))
    synchronized(lambda: group.step(0, measure=False), device)()

    def stretch():
        for _ in range(steps):
            group.step(next(done), measure=False)
    return study_speed.measure(synchronized(stretch, device), repeats) / steps


def max_diff_from_cpu(workload, config, global_batch: int, runs, device: torch.device) -> float | None:
    """The largest parameter difference after 10 steps between the group on ``device`` and on the CPU."""
    if study_speed.random_layers(workload):
        return None
    group = engine.Group(workload, config, grid_group(config, global_batch, runs), device=device)
    for step in range(10):
        group.step(step, measure=False)
    on_cpu = study_speed.vectorized(workload, config, global_batch, runs, 10)
    return max(float((group.params[name][row].cpu() - params[name]).abs().max())
               for row, params in enumerate(on_cpu) for name in params)


def row(workload, config, global_batch: int, device: torch.device, peak: float, steps: int, repeats: int) -> dict:
    runs = sweep.grid_runs(config, global_batch)
    flops = study_speed.group_flops_per_step(workload, config, global_batch, runs)
    floor_s = flops / peak
    seconds = step_s(workload, config, global_batch, runs, device, steps, repeats)
    engine_s = engine.seconds_per_step(workload, config, grid_group(config, global_batch, runs), device)
    return {"global_batch_size": global_batch, "runs": len(runs), "steps": steps, "group_flops_per_step": flops,
            "floor_s_per_step": floor_s, "s_per_step": seconds, "ratio_to_floor": seconds / floor_s,
            "engine_s_per_step": engine_s, "engine_ratio_to_floor": engine_s / floor_s,
            "max_abs_param_diff_vs_cpu": max_diff_from_cpu(workload, config, global_batch, runs, device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="digits", choices=["digits", "mnist1d", "charlm"])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="global batches (default: the workload's own grid)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("torch sees no CUDA device here: benchmarks/study_speed.py measures the CPU")
    device = torch.device("cuda", torch.cuda.current_device())
    workload = getattr(workloads, args.workload)()
    config = StudyConfig(**{"target": Target(kind="accuracy", value=0.95), **workloads.workload_defaults(workload)})
    peak = matmul_flops_per_s(device)
    print(json.dumps({"device": torch.cuda.get_device_name(device), "matmul_gflop_per_s": round(peak / 1e9, 1)}),
          flush=True)
    rows = []
    for global_batch in args.batch_sizes or config.global_batch_sizes:
        rows.append(row(workload, config, global_batch, device, peak, args.steps, args.repeats))
        print(json.dumps(rows[-1]), flush=True)
    result = {"benchmark": "study_speed_cuda", "workload": args.workload, "device": str(device),
              "device_name": torch.cuda.get_device_name(device), "matmul_flop_per_s": peak,
              "optimizer": config.optimizer.to_json(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "cpu_count": os.cpu_count(), "machine": platform.machine(), "rows": rows}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)
            fh.write("\n")


if __name__ == "__main__":
    main()
