"""The adaptive rules judged by the study: AdaScale and the batch ramp beside the best-tuned fixed lr.

Two workloads: the built-in digits MLP (target: 95% validation accuracy, the study's defaults),
and ``benchmarks/specs/teacher_mixture.py``, a student MLP learning a random teacher's labels with
10% of them flipped (target: 78% validation accuracy; its reference lr 0.0125 at global batch 32 is
the best of a sweep there, as AdaScale assumes of its reference). Each study trains the fixed rules,
``adascale`` and ``ramp`` on the same 3 seeds. Printed: AdaScale's median steps to the target over the
best-tuned lr's at each batch from the reference up, each seed's steps beside it (the goal: ≤ 1.2× at
8× and 32× the reference batch); and the ramp's median steps and samples over the best-tuned lr's at
its starting batch, the smallest of the grid (the goal: ≤ 0.6× the steps at ≤ 1.25× the samples).

    PYTHONPATH=src python benchmarks/study_adaptive.py [--out benchmarks/results/study_adaptive.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import torch

from ddplab.study import workloads
from ddplab.study.config import StudyConfig, StudyOptions, Target
from ddplab.study.grid.study import run_study

RULES = ("constant", "linear", "sqrt", "tuned", "adascale", "ramp")


def study(workload, config: StudyConfig) -> dict:
    with tempfile.TemporaryDirectory() as out:
        started = time.monotonic()
        report = run_study(workload, config, StudyOptions(out=out, plots=False)).to_json()
        report["seconds"] = time.monotonic() - started
    return report


def summarize(name: str, report: dict) -> list[dict]:
    rows = []
    for point in report["adascale"]:
        b = point["global_batch_size"]
        # Each seed's steps, for the spread: AdaScale's runs and the best tuned lr's.
        seeds = {rule: sorted(r["steps_to_target"] or float("inf") for r in report["runs"]
                              if r["global_batch_size"] == b and r["rule"] == rule and (rule != "tuned" or r["best"]))
                 for rule in ("adascale", "tuned")}
        row = {"workload": name, **point, "adascale_steps_by_seed": seeds["adascale"],
               "tuned_steps_by_seed": seeds["tuned"]}
        rows.append(row)
        ratio = "—" if point["steps_over_tuned"] is None else f"{point['steps_over_tuned']:.2f}×"
        print(f"{name:22s} B={b:5d} S={point['scale']:5g}  AdaScale {point['median_steps']:g} {seeds['adascale']} "
              f"vs tuned {point['tuned_median_steps']:g} {seeds['tuned']}: {ratio}  mean gain "
              f"{point['mean_gain']:.4f}")
    return rows


def ramp_summary(name: str, report: dict) -> dict:
    ramp = report["ramp"]
    runs = [r for r in report["runs"] if r["rule"] == "ramp"]
    start = ramp["start_global_batch_size"]
    best = [r for r in report["runs"] if r["rule"] == "tuned" and r["best"] and r["global_batch_size"] == start]
    print(f"{name:22s} ramp from B={start} at lr {ramp['lr']:g}: steps {[r['steps_to_target'] for r in runs]} vs "
          f"tuned {[r['steps_to_target'] for r in best]}: {ramp['steps_over_tuned']:.2f}× the steps, "
          f"{ramp['samples_over_tuned']:.2f}× the samples; final global batches {ramp['final_global_batch_sizes']}")
    return {**ramp, "ramp_steps_by_seed": [r["steps_to_target"] for r in runs],
            "ramp_samples_by_seed": [r["samples_to_target"] for r in runs],
            "tuned_steps_by_seed": [r["steps_to_target"] for r in best]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/study_adaptive.json")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    digits = study(workloads.digits(), StudyConfig(target=Target(kind="accuracy", value=0.95), rules=RULES))
    spec = os.path.join(os.path.dirname(os.path.abspath(__file__)), "specs", "teacher_mixture.py")
    mixture = study(workloads.from_spec(spec), StudyConfig(target=Target(kind="accuracy", value=0.78), rules=RULES,
                                                           reference_lr=0.0125, sweep_margin=8.0))
    rows = summarize("digits-mlp", digits) + summarize("teacher-mixture", mixture)
    ramps = {name: ramp_summary(name, report) for name, report in (("digits-mlp", digits),
                                                                   ("teacher-mixture", mixture))}
    result = {"rows": rows, "ramp": ramps, "fits": {"digits-mlp": digits["fit"], "teacher-mixture": mixture["fit"]},
              "tuned_lr": {"digits-mlp": digits["tuned_lr"], "teacher-mixture": mixture["tuned_lr"]},
              "seconds": {"digits-mlp": digits["seconds"], "teacher-mixture": mixture["seconds"]},
              "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "platform": platform.platform()}}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
