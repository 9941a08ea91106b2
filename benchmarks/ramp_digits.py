"""BatchRamp against the best-tuned fixed batch it starts from, on the digits MLP and the teacher-student spec.

One process (the ramp's one-process path: micro-batches of 8, measured as small batches, their mean as
the big one), SGD with momentum 0.9, seeds 0–2. The fixed runs train at global batch 16 with the best
lr ``ddplab study`` found there; the ramp starts at the same batch (2 micro-steps of 8) and lr, grows
its accumulation with the measured B_simple up to a global batch of 1024, the lr following the linear
rule with a 10-step warmup after each jump. Each run evaluates every 5 optimizer steps until the
validation accuracy first reaches the target; reported: optimizer steps, samples and the accuracy at
that evaluation (the goal: ≥ 40% fewer steps than the fixed run, ≤ 1.25× its samples).

    PYTHONPATH=src python benchmarks/ramp_digits.py [--out benchmarks/results/ramp_digits.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics

import torch

from ddplab.adapt.ramp import BatchRamp
from ddplab.noise.scale import GradientNoiseScale
from ddplab.study import workloads

MICRO, START_ACCUMULATION, MAX_ACCUMULATION, EVAL_EVERY, MAX_STEPS = 8, 2, 128, 5, 3000
SPEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "specs", "teacher_mixture.py")
# name → (workload, target accuracy, the best lr `ddplab study` found at global batch 16 for it)
CASES = {"digits-mlp": (workloads.digits, 0.95, 0.1),
         "teacher-mixture": (lambda: workloads.from_spec(SPEC), 0.78, 0.00625)}


def micro_batches(size: int, seed: int):
    """Micro-batches of MICRO indices, epoch after epoch, each epoch a fresh permutation (as a shuffled loader)."""
    epoch = 0
    while True:
        order = torch.randperm(size, generator=torch.Generator().manual_seed(1000 * seed + epoch))
        for start in range(0, size - MICRO + 1, MICRO):
            yield order[start:start + MICRO]
        epoch += 1


@torch.no_grad()
def accuracy(model, workload) -> float:
    inputs, targets = workload.val
    return float((model(inputs).argmax(1) == targets).float().mean())


def train(workload, target: float, lr: float, seed: int, *, ramp: bool) -> dict:
    torch.manual_seed(seed)
    model = workload.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    gns = GradientNoiseScale(model, per_device_batch_size=MICRO, accumulation_steps=START_ACCUMULATION, every=1,
                             dataset_size=workload.train_size)
    adapter = BatchRamp(model, optimizer, gns, max_accumulation_steps=MAX_ACCUMULATION, rule="linear",
                        warmup_steps=10) if ramp else None
    inputs, targets = workload.train
    stream, steps, samples, micro = micro_batches(workload.train_size, seed), 0, 0, 0
    while steps < MAX_STEPS:
        index = next(stream)
        window = adapter.accumulation_steps if adapter else START_ACCUMULATION
        (workload.loss(model(inputs[index]), targets[index]) / window).backward()
        micro, samples = micro + 1, samples + MICRO
        if micro < window:
            continue
        micro = 0
        gns.step()
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        if steps % EVAL_EVERY == 0:
            metric = accuracy(model, workload)
            if metric >= target:
                return {"steps": steps, "samples": samples, "accuracy": metric,
                        "final_global_batch": MICRO * window}
    return {"steps": None, "samples": samples, "accuracy": accuracy(model, workload),
            "final_global_batch": MICRO * window}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/ramp_digits.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = {}
    for name, (make, target, lr) in CASES.items():
        workload = make()
        runs = {kind: [train(workload, target, lr, seed, ramp=kind == "ramp") for seed in range(3)]
                for kind in ("fixed", "ramp")}
        medians = {kind: {key: statistics.median(r[key] for r in rs) for key in ("steps", "samples", "accuracy")}
                   for kind, rs in runs.items() if all(r["steps"] for r in rs)}
        out[name] = {"target": target, "lr": lr, "runs": runs, "medians": medians}
        for kind, rs in runs.items():
            print(f"{name:16s} {kind:5s}: steps {[r['steps'] for r in rs]}, samples {[r['samples'] for r in rs]}, "
                  f"final global batch {[r['final_global_batch'] for r in rs]}")
        if len(medians) == 2:
            steps = medians["ramp"]["steps"] / medians["fixed"]["steps"]
            samples = medians["ramp"]["samples"] / medians["fixed"]["samples"]
            print(f"{name:16s} ramp ÷ fixed (medians): steps {steps:.2f}×, samples {samples:.2f}×")
    out["machine"] = {"cpus": os.cpu_count(), "torch": torch.__version__, "platform": platform.platform()}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
