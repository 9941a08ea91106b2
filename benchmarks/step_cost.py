"""Per-step cost of ``ddplab noise`` and ``ddplab check`` against a plain DDP loop, as the dataset grows.

    python benchmarks/step_cost.py [--sizes 4000 40000 400000 4000000] [--steps 300] [--warmup 20] \
[--repeats 3] [--out benchmarks/results/step_cost.json]

One problem at every size: N samples of 10 Gaussian features, target their sum plus noise, a
torch.nn.Linear(10, 1), MSE loss, SGD lr 0.01, written as a ddplab spec file into a temporary
folder. Two CPU ranks (gloo), per-rank batch 8. Four things are timed, each training
warmup + steps steps:

- plain DDP: what a user writes, in each rank: DistributedSampler + DataLoader(batch_size=8,
  drop_last=True) + DistributedDataParallel + SGD, the loader iterated epoch after epoch.
- noise: ``ddplab noise --every 1``'s own rank loop (ddplab.noise.measure._measure_on_rank),
  GradientNoiseScale measuring every step, batches from RankOrder.
- check (ranks): ``ddplab check``'s own rank loop (ddplab.check.equivalence._train_on_rank),
  float64, recording the flat parameters and gradients every step.
- check (reference): ``ddplab check``'s single-process run on the ranks' batches concatenated
  (ddplab.check.equivalence.reference, hypothesis 'global'), in this process.

The library's loops run unchanged; a step is timed from the end of one ``optimizer.step()`` to the
end of the next (torch's global optimizer step post-hook), on rank 0 or in the reference's
process, so it covers everything the loop does per step: drawing the batch indices, collating,
forward, backward, DDP's all-reduce, the noise scale's or check's own work, the optimizer. Each
step is read on two clocks: wall (``time.perf_counter()``) and that process's CPU time
(``time.process_time()``, which other work on a shared machine disturbs less). The first
``warmup`` steps of each run are dropped; the sizes are run ``repeats`` times (every other pass
largest first) and the steps pooled; the tables show medians, so an epoch's one-off rebuild of its
order (or the sampler's reshuffle) does not move them, but a cost paid on every step does. That is
the point: the per-step cost must not grow with N.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import runpy
import statistics
import sys
import tempfile
import time

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DataLoader, DistributedSampler

from ddplab.check import equivalence
from ddplab.check.config import CheckConfig
from ddplab.noise import measure
from ddplab.noise.config import NoiseConfig
from ddplab.progress import silent
from ddplab.runtime.launch import LaunchConfig, launch
from ddplab.runtime.ranks import validate
from ddplab.runtime.sharding import RankOrder, ReferenceOrder, sampler_seed
from ddplab.runtime.spec import load_spec

WORLD_SIZE = 2
BATCH = 8
FEATURES = 10
LR = 0.01
SEED = 0
"""The runs' seed: model initialisation and data order (ddplab's --seed)."""
DATA_SEED = 1234
"""The seed the spec's dataset is drawn from."""
DEFAULT_SIZES = (4_000, 40_000, 400_000, 4_000_000)
DEADLINE_S = 1800.0
"""A launch still running after this is stopped (a hung rank, not a slow machine)."""
INT64_BYTES = 8
CLOCKS = ("wall", "cpu")
"""What each step is timed by: wall clock (perf_counter) and the process's CPU time (process_time)."""
Times = list[tuple[float, float]]
"""A clock's readings: (wall, CPU) seconds at the end of each step."""
VARIANTS = ("plain_ddp", "noise", "check_ranks", "check_reference")

SPEC_TEMPLATE = '''"""step_cost.py's problem: {samples} samples, y = sum(x) + noise, a linear model."""

import torch

SAMPLES = {samples}
FEATURES = {features}


def model():
    return torch.nn.Linear(FEATURES, 1)


def dataset():
    generator = torch.Generator().manual_seed({data_seed})
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = x.sum(dim=1, keepdim=True) + torch.randn(SAMPLES, 1, generator=generator)
    return torch.utils.data.TensorDataset(x, y)


def loss(output, target):
    return torch.nn.functional.mse_loss(output, target)


def optimizer(params):
    return torch.optim.SGD(params, lr={lr})
'''


class StepClock:
    """(perf_counter(), process_time()) at the end of every optimizer.step() in this process, while entered."""

    def __init__(self):
        self.times: Times = []

    def _tick(self, *_) -> None:
        self.times.append((time.perf_counter(), time.process_time()))

    def __enter__(self) -> StepClock:
        self._handle = register_optimizer_step_post_hook(self._tick)
        return self

    def __exit__(self, *_) -> None:
        self._handle.remove()


def step_ms(times: Times, warmup: int) -> dict[str, list[float]]:
    """Each step's wall and CPU ms, end of step i-1 to end of step i, for the steps after the first ``warmup``."""
    pairs = list(zip(times[warmup - 1:], times[warmup:]))
    return {clock: [1000 * (end[i] - start[i]) for start, end in pairs] for i, clock in enumerate(CLOCKS)}


def write_spec(folder: str, samples: int) -> str:
    path = os.path.join(folder, f"spec_{samples}.py")
    with open(path, "w") as fh:
        fh.write(SPEC_TEMPLATE.format(samples=samples, features=FEATURES, data_seed=DATA_SEED, lr=LR))
    return path


def _loader_batches(loader: DataLoader, sampler: DistributedSampler, steps: int):
    """The loader's batches, epoch after epoch (set_epoch before each), until ``steps`` were drawn."""
    drawn, epoch = 0, 0
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield batch
            drawn += 1
            if drawn == steps:
                return
        epoch += 1


def _plain_on_rank(ctx, spec_path: str, steps: int) -> Times | None:
    # The spec file's plain functions, without ddplab's guards: what a user's script would call.
    problem = runpy.run_path(spec_path)
    dataset = problem["dataset"]()
    torch.manual_seed(SEED)
    model = DistributedDataParallel(problem["model"]().to(ctx.device), device_ids=ctx.device_ids)
    optimizer = problem["optimizer"](model.parameters())
    # ddplab's order is DistributedSampler's under this seed: both train on the same batches.
    sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                                 seed=sampler_seed(SEED))
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, drop_last=True)
    with StepClock() as clock:
        for inputs, target in _loader_batches(loader, sampler, steps):
            optimizer.zero_grad(set_to_none=True)
            problem["loss"](model(inputs.to(ctx.device)), target.to(ctx.device)).backward()
            optimizer.step()
    return clock.times if ctx.is_main else None


def _noise_on_rank(ctx, config: NoiseConfig, facts) -> tuple[Times, int] | None:
    with StepClock() as clock:
        report = measure._measure_on_rank(ctx, (config, silent), facts)
    return (clock.times, len(report.history)) if ctx.is_main else None


def _check_on_rank(ctx, config: CheckConfig, facts) -> Times | None:
    with StepClock() as clock:
        equivalence._train_on_rank(ctx, config, facts)
    return clock.times if ctx.is_main else None


def _launch(fn, *args):
    return launch(fn, LaunchConfig(world_size=WORLD_SIZE, deadline_s=DEADLINE_S), *args)[0]


def time_plain(spec_path: str, total_steps: int) -> Times:
    return _launch(_plain_on_rank, spec_path, total_steps)


def time_noise(spec_path: str, total_steps: int) -> tuple[Times, int]:
    """``ddplab noise --every 1``'s rank loop: rank 0's step end times, and how many steps it measured."""
    config = NoiseConfig(spec_path=spec_path, per_device_batch_size=BATCH, world_size=WORLD_SIZE, steps=total_steps,
                         seed=SEED, every=1)
    # As measure_spec does before it launches.
    facts, _ = validate(load_spec(spec_path), world_size=WORLD_SIZE, seed=SEED, per_device_batch_size=BATCH,
                        drop_last=True)
    return _launch(_noise_on_rank, config, facts)


def time_check(spec_path: str, total_steps: int) -> tuple[Times, Times]:
    """``ddplab check``'s rank loop, then its single-process reference: the step end times of each."""
    config = CheckConfig(spec_path=spec_path, per_device_batch_size=BATCH, world_size=WORLD_SIZE, steps=total_steps,
                         seed=SEED)
    # As check() does: validate, train on the ranks, then the reference on validate's dataset.
    spec = load_spec(spec_path)
    facts, dataset = validate(spec, world_size=WORLD_SIZE, seed=SEED, dtype=torch.float64,
                              per_device_batch_size=BATCH)
    ranks = _launch(_check_on_rank, config, facts)
    with StepClock() as clock:
        equivalence.reference(spec, dataset, config, "global")
    return ranks, clock.times


def order_bytes(samples: int) -> dict[str, int]:
    """What ddplab's orders hold between epochs (read from the objects), and a rebuild's transient peak."""
    rank = RankOrder(samples, world_size=WORLD_SIZE, rank=0, per_device_batch_size=BATCH, seed=SEED, drop_last=True)
    rank.batch(0)
    reference = ReferenceOrder(samples, world_size=WORLD_SIZE, per_device_batch_size=BATCH, seed=SEED)
    reference.batch(0)
    padded_size = -(-samples // WORLD_SIZE) * WORLD_SIZE
    # Computed: the epoch's permutation, and its padded copy when N % W != 0, live until the shard is cut out.
    permutation = INT64_BYTES * (samples + (padded_size if padded_size != samples else 0))
    return {"rank_shard_bytes": rank._shard.nbytes, "reference_order_bytes": reference._order.nbytes,
            "rank_rebuild_peak_bytes": permutation + rank._shard.nbytes}


def summary(durations_ms: list[float]) -> dict[str, float]:
    ordered = sorted(durations_ms)
    return {"median_ms": statistics.median(ordered), "mean_ms": statistics.fmean(ordered),
            "p90_ms": ordered[int(0.9 * (len(ordered) - 1))], "max_ms": ordered[-1], "steps": len(ordered)}


def _log(message: str, started: float) -> None:
    print(f"[{time.perf_counter() - started:7.1f} s] {message}", file=sys.stderr, flush=True)


def run_once(spec_path: str, steps: int, warmup: int) -> dict:
    """Every variant once on one spec, one after another: each one's per-step wall and CPU ms."""
    total = warmup + steps
    load_before = os.getloadavg()
    plain = time_plain(spec_path, total)
    noise, measured = time_noise(spec_path, total)
    check_ranks, check_reference = time_check(spec_path, total)
    variants = {"plain_ddp": plain, "noise": noise, "check_ranks": check_ranks, "check_reference": check_reference}
    run = {"loadavg_before": load_before, "loadavg_after": os.getloadavg(), "steps_run": total,
           "noise_measured_steps": measured}
    per_step = {name: step_ms(times, warmup) for name, times in variants.items()}
    for clock in CLOCKS:
        run[f"{clock}_ms"] = {name: [round(d, 4) for d in values[clock]] for name, values in per_step.items()}
    return run


def sweep(sizes: list[int], steps: int, warmup: int, repeats: int, started: float) -> list[dict]:
    """Every size ``repeats`` times, in reverse order on every other pass so drift does not line up with size."""
    runs: dict[int, list[dict]] = {samples: [] for samples in sizes}
    with tempfile.TemporaryDirectory(prefix="ddplab-step-cost-") as folder:
        specs = {samples: write_spec(folder, samples) for samples in sizes}
        for repeat in range(repeats):
            for samples in sizes if repeat % 2 == 0 else sizes[::-1]:
                runs[samples].append(run_once(specs[samples], steps, warmup))
                _log(f"pass {repeat + 1}/{repeats}: {samples:,} samples done", started)
    return [size_record(samples, runs[samples]) for samples in sizes]


def size_record(samples: int, runs: list[dict]) -> dict:
    """One size's runs, and each variant's steps pooled over them, summarised per clock."""
    record = {"samples": samples, "memory": order_bytes(samples)}
    for clock in CLOCKS:
        record[clock] = {name: summary([d for run in runs for d in run[f"{clock}_ms"][name]]) for name in VARIANTS}
    # Each pass summarised too (its own median per variant): the raw steps would make the file a megabyte.
    record["runs"] = [{**{key: value for key, value in run.items() if not key.endswith("_ms")},
                       **{f"{clock}_median_ms": {name: statistics.median(run[f"{clock}_ms"][name]) for name in VARIANTS}
                          for clock in CLOCKS}} for run in runs]
    return record


def _median(record: dict, clock: str, name: str) -> float:
    return record[clock][name]["median_ms"]


def check_total(record: dict, clock: str) -> float:
    """One ``ddplab check`` step: the ranks' step, then the reference's (they run one after the other)."""
    return _median(record, clock, "check_ranks") + _median(record, clock, "check_reference")


def _size_text(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def table(records: list[dict], clock: str) -> str:
    lines = ["| samples | plain DDP ms/step | noise ms/step | noise ÷ plain | check (ranks) ms/step "
             "| check (reference) ms/step | check (ranks + reference) ms/step | rank's cached order |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        plain, noise = _median(r, clock, "plain_ddp"), _median(r, clock, "noise")
        lines.append(f"| {r['samples']:,} | {plain:.3f} | {noise:.3f} | {noise / plain:.2f} "
                     f"| {_median(r, clock, 'check_ranks'):.3f} | {_median(r, clock, 'check_reference'):.3f} "
                     f"| {check_total(r, clock):.3f} | {_size_text(r['memory']['rank_shard_bytes'])} |")
    return "\n".join(lines)


def growth(records: list[dict], clock: str) -> dict[str, float]:
    """Median ms/step at the largest size ÷ at the smallest, per variant (1.0: no growth)."""
    small, large = min(records, key=lambda r: r["samples"]), max(records, key=lambda r: r["samples"])
    ratios = {name: _median(large, clock, name) / _median(small, clock, name) for name in VARIANTS}
    ratios["check_total"] = check_total(large, clock) / check_total(small, clock)
    return ratios


def growth_text(records: list[dict], ratios: dict[str, float]) -> str:
    sizes = sorted(r["samples"] for r in records)
    if sizes[0] == sizes[-1]:
        return "One size only: no growth to report."
    return (f"Growth {sizes[0]:,} → {sizes[-1]:,} samples (median ms/step, largest ÷ smallest): "
            f"noise ×{ratios['noise']:.2f}, check ×{ratios['check_total']:.2f} "
            f"(ranks ×{ratios['check_ranks']:.2f}, reference ×{ratios['check_reference']:.2f}); "
            f"plain DDP ×{ratios['plain_ddp']:.2f}")


def report(records: list[dict], steps: int, repeats: int) -> str:
    """The wall-clock table and its growth, then the same for CPU time."""
    pooled = f"median of {steps} steps × {repeats} pass{'es' if repeats > 1 else ''}"
    return "\n".join([
        f"Wall clock per step ({pooled}; rank 0, the reference in one process):", "", table(records, "wall"), "",
        growth_text(records, growth(records, "wall")), "",
        f"CPU time per step of the same process ({pooled}; less sensitive to other work on the machine):", "",
        table(records, "cpu"), "", growth_text(records, growth(records, "cpu"))])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="dataset sizes N")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per variant, size and pass")
    parser.add_argument("--warmup", type=int, default=20, help="steps run before the timed ones (at least 1)")
    parser.add_argument("--repeats", type=int, default=3, help="passes over the sizes; their steps are pooled")
    parser.add_argument("--out", help="write the raw numbers here as JSON")
    args = parser.parse_args()
    if min(args.steps, args.warmup, args.repeats) < 1:
        parser.error("--steps, --warmup and --repeats must be at least 1")
    if min(args.sizes) < WORLD_SIZE * BATCH:
        parser.error(f"every size must hold at least one global batch ({WORLD_SIZE * BATCH} samples)")
    return args


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    load_before = os.getloadavg()
    records = sweep(args.sizes, args.steps, args.warmup, args.repeats, started)
    print(report(records, args.steps, args.repeats))
    _log("finished", started)
    if args.out:
        result = {"machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, {platform.platform()}",
                  "torch": torch.__version__, "cpu_count": os.cpu_count(), "loadavg_before": load_before,
                  "loadavg_after": os.getloadavg(), "wall_s": time.perf_counter() - started,
                  "world_size": WORLD_SIZE, "per_device_batch_size": BATCH, "features": FEATURES, "lr": LR,
                  "seed": SEED, "warmup_steps": args.warmup, "timed_steps": args.steps, "repeats": args.repeats,
                  "growth": {clock: growth(records, clock) for clock in CLOCKS}, "sizes": records}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
