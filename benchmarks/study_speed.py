"""ddplab study's vectorized engine against a Python loop over the same runs, and against the machine's floor.

The same runs (a built-in workload, one global batch, its default lrs × seeds and optimizer,
fixed steps) trained two ways in one sitting: all at once through ``Group`` (vmap over stacked
parameters), and one after another, each a plain nn.Module with its torch.optim optimizer. Both
must end at the same parameters (checked), then the wall-clock ratio is the speed-up.

The floor: the group's FLOPs per step (counted by torch.utils.flop_counter on one real step)
divided by the sustained FLOP/s of a large float32 matrix product on this machine (measured here,
at each thread count). ``ratio_to_floor`` is the group's time per step over that floor: 1 would be
every step running at matmul peak. Each row also says which engine ``--engine fastest`` picks there
(``auto_picks``: the timed choice was once the default, ``auto``).

    PYTHONPATH=src python benchmarks/study_speed.py [--workload digits|mnist1d|charlm] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from ddplab.runtime.launch import LaunchConfig
from ddplab.study import engines, optim, workloads
from ddplab.study.config import StudyConfig, Target
from ddplab.study.engines import ddp
from ddplab.study.engines import vmap as engine
from ddplab.study.rules import sweep
from ddplab.study.runs import grid_group


def loop_over_runs(workload, config, global_batch: int, runs, steps: int):
    """The baseline: each run its own model and optimizer, trained to the end before the next."""
    out = []
    batches = engine.Batches(workload.train_size, global_batch, sorted({seed for _, seed in runs}))
    inputs, targets = workload.train
    for lr, seed in runs:
        model = workload.model()
        model.load_state_dict(engine.seeded_state(workload, seed, torch.float32)[0], strict=False)
        optimizer = optim.torch_optimizer(config.optimizer, model.parameters(), lr)
        row = batches.seeds.index(seed)
        for step in range(steps):
            index = batches.indices(step)[row]
            optimizer.zero_grad(set_to_none=True)
            workload.loss(model(inputs[index]), targets[index]).backward()
            optimizer.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def vectorized(workload, config, global_batch: int, runs, steps: int):
    group = engine.Group(workload, config, grid_group(config, global_batch, runs))
    for step in range(steps):
        group.step(step, measure=False)
    return [{n: p[row].clone() for n, p in group.params.items()} for row in range(len(runs))]


def random_layers(workload) -> bool:
    return any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in workload.model().modules())


def group_flops_per_step(workload, config, global_batch: int, runs) -> int:
    """FLOPs of one vectorized step of every run (matrix products and convolutions, forward and backward)."""
    group = engine.Group(workload, config, grid_group(config, global_batch, runs))
    group.step(0, measure=False)
    with FlopCounterMode(display=False) as counter:
        group.step(1, measure=False)
    return counter.get_total_flops()


def matmul_flops_per_s(threads: int, size: int = 2048, repeats: int = 5) -> float:
    """Sustained float32 FLOP/s of a large matrix product at ``threads`` threads: the best of ``repeats``."""
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = measure(lambda: [a @ b for _ in range(4)], repeats)
    return 4 * 2 * size ** 3 / best


def measure(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def whole_default_study() -> dict:
    """``ddplab study`` with its defaults, from scratch, in this process."""
    import contextlib
    import io
    import resource
    import tempfile

    from ddplab.cli.main import main as cli_main

    with tempfile.TemporaryDirectory() as out:
        load = os.getloadavg()
        cpu = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            code = cli_main(["study", "--out", out, "--fresh", "--json"])
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
    report = json.loads(printed.getvalue())
    tuned = report["fit"]["tuned"]
    return {"exit_code": code, "wall_s": wall, "cpu_s": after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime,
            "load_average_before": load, "runs": len(report["runs"]), "tuned_b_crit": tuned["b_crit"],
            "tuned_b_crit_ci95": tuned["b_crit_ci95"], "b_simple": report["b_simple"],
            "tuned_median_steps": tuned["median_steps"]}


def timed(fn, threads: int, repeats: int) -> float:
    torch.set_num_threads(threads)
    return measure(fn, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="digits", choices=["digits", "mnist1d", "charlm"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                        help="intra-op thread counts to try; each side is timed at its best (default 1 2)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="global batches (default: the workload's own grid)")
    parser.add_argument("--default-study", action="store_true",
                        help="also time the whole default `ddplab study` (plots included), CPU seconds beside wall")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    workload = getattr(workloads, args.workload)()
    defaults = workloads.workload_defaults(workload)
    config = StudyConfig(**{"target": Target(kind="accuracy", value=0.95), **defaults})
    load_before = os.getloadavg()
    peak = {t: matmul_flops_per_s(t) for t in args.threads}
    print(json.dumps({"matmul_gflop_per_s_by_threads": {t: round(f / 1e9, 1) for t, f in peak.items()}}), flush=True)
    rows = []
    for global_batch in args.batch_sizes or config.global_batch_sizes:
        runs = sweep.grid_runs(config, global_batch)
        # Same answer both ways first: the speed-up compares equal work. Dropout draws other masks in the group
        # than in the loop, so with dropout the two cannot be compared number for number.
        diff = None if random_layers(workload) else max(
            float((a[n] - b[n]).abs().max()) for a, b in zip(vectorized(workload, config, global_batch, runs, 10),
                                                             loop_over_runs(workload, config, global_batch, runs, 10))
            for n in a)
        loop_s = {t: timed(lambda b=global_batch, r=runs: loop_over_runs(workload, config, b, r, args.steps), t,
                           args.repeats) for t in args.threads}
        vmap_s = {t: timed(lambda b=global_batch, r=runs: vectorized(workload, config, b, r, args.steps), t,
                           args.repeats) for t in args.threads}
        best_loop, best_vmap = min(loop_s.values()), min(vmap_s.values())
        flops = group_flops_per_step(workload, config, global_batch, runs)
        # The floor at the thread count the group ran fastest with.
        threads = min(vmap_s, key=vmap_s.get)
        floor_s = flops / peak[threads]
        torch.set_num_threads(threads)
        on_engines = [engine.VmapEngine(), ddp.DdpEngine(LaunchConfig())]
        picked, seconds = engines.fastest(on_engines, workload, config, grid_group(config, global_batch, runs))
        picks = picked.name
        rows.append({"global_batch_size": global_batch, "runs": len(runs), "steps": args.steps,
                     "loop_s_by_threads": loop_s, "vectorized_s_by_threads": vmap_s,
                     "speedup_best_vs_best": best_loop / best_vmap,
                     "speedup_at_1_thread": loop_s.get(1, best_loop) / vmap_s.get(1, best_vmap),
                     "group_flops_per_step": flops, "floor_s_per_step": floor_s,
                     "vectorized_s_per_step": best_vmap / args.steps,
                     "ratio_to_floor": best_vmap / args.steps / floor_s,
                     "auto_picks": picks,
                     "auto_timing_s_per_step": {"vectorized": seconds["vmap"], "run_by_run": seconds["ddp"]},
                     "max_abs_param_diff_after_10_steps": diff})
        print(json.dumps(rows[-1]), flush=True)
    default_study = whole_default_study() if args.default_study else None
    result = {"benchmark": "study_speed", "workload": args.workload, "default_study": default_study,
              "optimizer": config.optimizer.to_json(),
              "matmul_flop_per_s_by_threads": peak, "torch": torch.__version__,
              "cpu_count": os.cpu_count(), "machine": platform.machine(), "load_average_before": load_before,
              "load_average_after": os.getloadavg(), "rows": rows}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)
            fh.write("\n")


if __name__ == "__main__":
    main()
