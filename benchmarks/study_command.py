"""`ddplab study -- COMMAND`: the wall time of a study with --parallel 2 against --parallel 1, and ddplab's own cost
per run (launch, guest, stop) as a fraction of the run.

    python benchmarks/study_command.py [--rounds 3] [--out PATH.json]

The command is examples/padded_lm/train.py in one process per run (global batches 16, 32 and 64 as micro-batches
of 8 with accumulation; rules constant, linear and sqrt; one seed: 7 runs to loss 1.7). The two settings alternate
`--rounds` times, each a fresh study. Then each run of the last --parallel 1 study is started again without ddplab,
for exactly the optimizer steps the guest stopped it at (`--max-steps`), and its wall time is set against the
run's own under the study (result.json's seconds: the command's start to its exit), beside the guest's own time in
the run (its hooks and the evaluations' all-reduce, as the guest counts it on rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(os.path.dirname(HERE), "examples", "padded_lm", "train.py")
GRID = ["--target-loss", "1.7", "--global-batch-sizes", "16,32,64", "--seeds", "1", "--rules", "constant,linear,sqrt",
        "--optimizer", "adamw", "--ref-global-batch-size", "16", "--ref-lr", "1e-2", "--eval-every", "5",
        "--max-steps", "300", "--no-plots", "--json", "--world-size", "1", "--max-batch-size-per-device", "8"]
COMMAND = [sys.executable, SCRIPT, "--batch-size", "{per_device_batch_size}", "--grad-accum", "{accumulation_steps}",
           "--lr", "{lr}", "--seed", "{seed}"]


def _study(out: str, parallel: int) -> tuple[float, dict]:
    begin = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ddplab", "study", *GRID, "--out", out, "--fresh", "--parallel",
                           str(parallel), "--", *COMMAND], capture_output=True, text=True, timeout=1800, check=False)
    wall = time.perf_counter() - begin
    if done.returncode != 0:
        raise RuntimeError(f"study failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return wall, json.loads(done.stdout)


def _plain(args: list[str], steps: int) -> float:
    begin = time.perf_counter()
    subprocess.run([*args, "--max-steps", str(steps)], capture_output=True, timeout=900, check=True)
    return time.perf_counter() - begin


def _runs(out: str) -> list[dict]:
    root = os.path.join(out, "command-runs")
    found = []
    for fingerprint in os.listdir(root):
        for run in sorted(os.listdir(os.path.join(root, fingerprint))):
            with open(os.path.join(root, fingerprint, run, "result.json")) as fh:
                found.append(json.load(fh))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "study_command.json"))
    args = parser.parse_args()
    walls: dict[int, list[float]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as work:
        for round_ in range(args.rounds):
            for parallel in ((1, 2) if round_ % 2 == 0 else (2, 1)):
                wall, report = _study(os.path.join(work, f"p{parallel}"), parallel)
                walls[parallel].append(wall)
                print(f"--parallel {parallel}: {wall:.1f} s, {report['trained_runs']} runs", flush=True)
        costs = []
        for run in _runs(os.path.join(work, "p1")):
            steps = run["result"]["history"][-1][0]
            alone = _plain(run["args"], steps)
            costs.append({"steps": steps, "under_study_s": run["seconds"], "alone_s": alone,
                          "guest_s": run["guest_seconds"], "guest_fraction": run["guest_seconds"] / run["seconds"]})
            print(f"run to {steps} steps: {run['seconds']:.2f} s under the study (guest {run['guest_seconds']:.3f} s), "
                  f"{alone:.2f} s alone", flush=True)
    result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load": os.getloadavg()},
        "runs": report["trained_runs"],
        "parallel_1_s": walls[1], "parallel_2_s": walls[2],
        "median_parallel_1_s": statistics.median(walls[1]), "median_parallel_2_s": statistics.median(walls[2]),
        "speedup": statistics.median(walls[1]) / statistics.median(walls[2]),
        "per_run": costs,
        "median_guest_s": statistics.median(c["guest_s"] for c in costs),
        "median_guest_fraction": statistics.median(c["guest_fraction"] for c in costs),
        "median_under_study_s": statistics.median(c["under_study_s"] for c in costs),
        "median_alone_s": statistics.median(c["alone_s"] for c in costs),
    }
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "per_run"}, indent=2))


if __name__ == "__main__":
    main()
