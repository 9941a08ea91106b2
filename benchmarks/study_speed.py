"""ddplab study's vectorized engine against a Python loop over the same runs, side by side.

The same runs (the built-in digits MLP, one global batch, several lrs × seeds, SGD with
momentum, fixed steps) trained two ways in one sitting: all at once through ``Group`` (vmap over
stacked parameters), and one after another, each a plain nn.Module with torch.optim.SGD. Both
must end at the same parameters (checked), then the wall-clock ratio is the speed-up.

    PYTHONPATH=src python benchmarks/study_speed.py [--out benchmarks/results/study_speed.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from ddplab.study import engine, workloads
from ddplab.study.config import StudyConfig, Target


def loop_over_runs(workload, config, global_batch: int, runs, steps: int):
    """The baseline: each run its own model and optimizer, trained to the end before the next."""
    out = []
    batches = engine._Batches(workload.train_size, global_batch, sorted({seed for _, seed in runs}))
    inputs, targets = workload.train
    for lr, seed in runs:
        torch.manual_seed(seed)
        model = workload.model()
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=config.optimizer.momentum)
        row = batches.seeds.index(seed)
        for step in range(steps):
            index = batches.indices(step)[row]
            optimizer.zero_grad(set_to_none=True)
            workload.loss(model(inputs[index]), targets[index]).backward()
            optimizer.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def vectorized(workload, config, global_batch: int, runs, steps: int):
    group = engine.Group(workload, config, global_batch, runs)
    for step in range(steps):
        group.step(step, measure=False)
    return [{n: p[row].clone() for n, p in group.params.items()} for row in range(len(runs))]


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
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                        help="intra-op thread counts to try; each side is timed at its best (default 1 2)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16, 64, 256, 1024])
    parser.add_argument("--default-study", action="store_true",
                        help="also time the whole default `ddplab study` (plots included), CPU seconds beside wall")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    workload = workloads.digits()
    config = StudyConfig(target=Target(kind="accuracy", value=0.95))
    load_before = os.getloadavg()
    rows = []
    for global_batch in args.batch_sizes:
        runs = config.grid_runs(global_batch)
        # Same answer both ways first: the speed-up compares equal work.
        diff = max(float((a[n] - b[n]).abs().max()) for a, b in
                   zip(vectorized(workload, config, global_batch, runs, 10),
                       loop_over_runs(workload, config, global_batch, runs, 10)) for n in a)
        loop_s = {t: timed(lambda b=global_batch, r=runs: loop_over_runs(workload, config, b, r, args.steps), t,
                           args.repeats) for t in args.threads}
        vmap_s = {t: timed(lambda b=global_batch, r=runs: vectorized(workload, config, b, r, args.steps), t,
                           args.repeats) for t in args.threads}
        best_loop, best_vmap = min(loop_s.values()), min(vmap_s.values())
        rows.append({"global_batch_size": global_batch, "runs": len(runs), "steps": args.steps,
                     "loop_s_by_threads": loop_s, "vectorized_s_by_threads": vmap_s,
                     "speedup_best_vs_best": best_loop / best_vmap,
                     "speedup_at_1_thread": loop_s.get(1, best_loop) / vmap_s.get(1, best_vmap),
                     "max_abs_param_diff_after_10_steps": diff})
        print(json.dumps(rows[-1]), flush=True)
    default_study = whole_default_study() if args.default_study else None
    result = {"benchmark": "study_speed", "default_study": default_study, "torch": torch.__version__,
              "cpu_count": os.cpu_count(), "machine": platform.machine(), "load_average_before": load_before,
              "load_average_after": os.getloadavg(), "rows": rows}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)
            fh.write("\n")


if __name__ == "__main__":
    main()
