"""The DDP engine: each grid point trained as a real DDP run, one launch per global batch for all its runs.

The ranks wrap the model with the engine's parallelism strategy: DDP by default, FSDP2 or HSDP when
asked (:mod:`ddplab.runtime.strategies`); the rest of the loop is the same for all three.

For what the vectorized engine cannot train: a spec's own ``step()`` or ``collate()``, an optimizer outside SGD,
Adam and AdamW, a model that does not vmap, BatchNorm whose statistics must be per rank, or a
study under torchrun across nodes. The launch layer (:mod:`ddplab.runtime.launch`) starts
``world_size`` ranks once per global batch (or joins torchrun's group), and they train that
batch's runs in turn. Each rank takes its DistributedSampler share of the engine's global batch
(the order :mod:`ddplab.study.orders` gives, so both engines see the same samples at each step),
in ``accumulation`` micro-batches under ``no_sync`` when the per-rank batch is capped.

A group whose lr scales with AdaScale's gain is driven by ``ddplab.AdaScale`` itself, on the noise
scale measured across the ranks at every step: what a user's DDP loop would run. Every decision to
stop is one all ranks take together, from one all-reduce per evaluation (:class:`Evaluation`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ddplab.errors import UsageError
from ddplab.runtime import strategies
from ddplab.runtime.launch import LaunchConfig, RankContext, launch
from ddplab.runtime.ranks import rank_errors
from ddplab.study import workloads
from ddplab.study.config import StudyConfig
from ddplab.study.engines.base import Progress
from ddplab.study.engines.vmap import evaluate_model, synchronize
from ddplab.study.optim import torch_dtype, torch_optimizer
from ddplab.study.orders import Batches, RankShards
from ddplab.study.runs import DIVERGED_LOSS, RunGroup, RunResult, prune_bound, settle
from ddplab.study.workloads import run_optimizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class DdpPlan:
    """How the ranks split one global batch."""

    world_size: int
    accumulation_steps: int
    per_device_batch_size: int
    """The loader batch of each rank and micro-step."""


def split(global_batch: int, world_size: int, max_per_device: int | None) -> DdpPlan:
    """The fewest accumulation steps that keep each rank's micro-batch at most ``max_per_device``."""
    if global_batch % world_size:
        raise UsageError(f"global batch {global_batch} does not split evenly over {world_size} DDP ranks "
                         "({world_size}): choose {global_batch_sizes} that are multiples of it")
    per_rank = global_batch // world_size
    cap = max_per_device or per_rank
    accumulation = next(a for a in range(1, per_rank + 1) if per_rank % a == 0 and per_rank // a <= cap)
    return DdpPlan(world_size=world_size, accumulation_steps=accumulation,
                   per_device_batch_size=per_rank // accumulation)


def train_group_ddp(workload: workloads.Workload, config: StudyConfig, group: RunGroup,
                    launch_config: LaunchConfig, *, max_per_device: int | None = None,
                    strategy: strategies.Strategy | None = None) -> list[RunResult]:
    """Train every run of ``group`` on ``launch_config.world_size`` DDP ranks, one after another.

    As in the vectorized engine, a run of an lr in ``group.sweep_only`` stops once it can no longer have the
    fewest median steps; the rules' lrs train first, so a best is settled early. Under AdaScale's lr scaling each
    run is driven by ``ddplab.AdaScale`` itself, fed by the noise scale measured across the ranks at every step."""
    plan = split(group.global_batch_size, launch_config.world_size, max_per_device)
    if group.lr_scaling == "gain" and launch_config.world_size < 2:
        raise UsageError("AdaScale on the DDP engine measures the noise scale across ranks: it needs {world_size} 2 "
                         "or more")
    strategy = strategy or strategies.get()
    if group.lr_scaling == "gain" and not strategy.taps_local_gradients:
        raise UsageError(f"AdaScale reads each rank's local gradient, which the {strategy.name} strategy does not "
                         "show: drop the gain rule from {rules}")
    # Every rank returns the same results (each stop is decided together): rank 0's serve. A spec's error in a
    # rank (its evaluate() raising, say) comes back as the one line it is in one process.
    with rank_errors():
        return launch(_train_runs, launch_config, workload.source, config, group, plan, strategy)[0]


def _train_runs(ctx: RankContext, source, config: StudyConfig, group: RunGroup, plan: DdpPlan,
                strategy: strategies.Strategy) -> list[RunResult]:
    # Rebuilt in the rank: a spawned rank cannot receive closures or a loaded spec through pickle.
    workload = workloads.load(source)
    read = workload.batches(ctx.device, torch_dtype(config))
    results = dict(zip(group.keys(), group.results()))
    optimizers = dict(zip(group.keys(), group.run_optimizers()))
    done: list[RunResult] = []
    for key in sorted(group.keys(), key=lambda key: (key[0], key[2]) in group.sweep_only):
        result = results[key]
        setting = (result.lr, result.variant)
        bound = prune_bound(config, done, setting) if setting in group.sweep_only else math.inf
        # Each run steps with its own optimizer (the tuned sweep's Adam variants share a group).
        _train_one(ctx, workload, dataclasses.replace(config, optimizer=optimizers[key]), plan, read, result,
                   bound, strategy, adascale=group.lr_scaling == "gain")
        done.append(result)
    return [results[key] for key in group.keys()]


def _train_one(ctx: RankContext, workload: workloads.Workload, config: StudyConfig, plan: DdpPlan,
               read: Callable[[torch.Tensor], Any], result: RunResult, bound: float = math.inf,
               strategy: strategies.Strategy | None = None, *, adascale: bool = False) -> None:
    torch.manual_seed(result.seed)
    model = workload.model().to(torch_dtype(config)).to(ctx.device)
    strategy = strategy or strategies.get()
    training = strategy.training(model, lambda params: run_optimizer(workload, config, params, result.lr), ctx,
                                 accumulation_steps=plan.accumulation_steps,
                                 per_device_batch_size=plan.per_device_batch_size)
    scaler = None
    try:
        shards = RankShards(workload.train_size, result.global_batch_size, ctx, result.seed)
        # Dropout's masks differ per rank and per run, the same every time the grid runs.
        torch.manual_seed(1_000_003 * result.seed + ctx.rank)
        noise = _noise_scale(training.model, ctx, plan, config, workload.train_size, every_step=adascale,
                             strategy=strategy)
        scaler = _adascale(training.optimizer, noise, config) if adascale else None
        # The step losses since the last evaluation, kept as tensors: read once per evaluation, never per step.
        losses: list[torch.Tensor] = []
        for step in range(config.max_steps):
            index = shards.batch(step).to(ctx.device)
            parts = []
            for micro, part in enumerate(index.chunk(plan.accumulation_steps)):
                with training.micro_batch(last=micro == plan.accumulation_steps - 1):
                    value = workload.step_fn(training.model, read(part), workload.loss)
                    training.backward(value, parts=plan.accumulation_steps)
                parts.append(value.detach())
            losses.append(parts[0] if len(parts) == 1 else torch.stack(parts).to(torch.float64).mean())
            evaluation = (step + 1) % config.eval_every == 0
            sums = None
            if scaler is not None:
                # AdaScale's gain for this update needs the step's measurement now.
                estimate = noise.step()
                if evaluation:
                    _record(estimate, result)
            elif noise is not None:
                # Measured at evaluations only; its sums travel in the evaluation's all-reduce.
                sums = noise.local_sums()
            training.step()
            if scaler is not None and evaluation:
                applied = scaler.history[-1]
                result.gains.append([step + 1, applied.gain, applied.tau])
            # A diverged step poisons every later one (its gradient is all-reduced), so checking the window's losses
            # at each evaluation stops the same runs; one collective per evaluation instead of one per step.
            if evaluation or step + 1 == config.max_steps:
                if _evaluated(ctx, workload, config, training.module, result, step + 1, losses, noise, sums,
                              every_rank=strategy.collective_forward):
                    break
                if step + 1 > bound:
                    result.pruned = True
                    break
                losses.clear()
    finally:
        if scaler is not None:
            scaler.remove()
        training.close()
    del training, model, scaler


def _adascale(optimizer, noise, config: StudyConfig):
    """ddplab's AdaScale over this run's optimizer: its lr (the reference lr) times the measured gain."""
    from ddplab.adapt.adascale import AdaScale

    return AdaScale(optimizer, noise, reference_batch_size=config.reference_global_batch_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Evaluation:
    """What every rank learns at an evaluation, from one all-reduce: each field is summed over the ranks."""

    loss: float
    """The last step's training loss (its mean is this over the world size)."""
    metric: float
    """Rank 0's evaluation (the other ranks add 0)."""
    diverged: float
    """Ranks whose losses since the last evaluation diverged."""
    noise_sums: tuple[float, float] = (0.0, 0.0)
    """The noise scale's two sums of the step (GradientNoiseScale.local_sums)."""

    def pack(self, like: torch.Tensor) -> torch.Tensor:
        return like.new_tensor([self.loss, self.metric, self.diverged, *self.noise_sums])

    @classmethod
    def unpack(cls, tensor: torch.Tensor) -> Evaluation:
        loss, metric, diverged, *sums = tensor.tolist()
        return cls(loss=loss, metric=metric, diverged=diverged, noise_sums=tuple(sums))

    def all_reduced(self, like: torch.Tensor) -> Evaluation:
        shared = self.pack(like)
        dist.all_reduce(shared)
        return Evaluation.unpack(shared)


def _evaluated(ctx: RankContext, workload, config: StudyConfig, model, result: RunResult, steps: int,
               losses: list[torch.Tensor], noise=None, sums: torch.Tensor | None = None, *,
               every_rank: bool = False) -> bool:
    """Rank 0 evaluates; one all-reduce (:class:`Evaluation`) tells every rank the metric, the mean of the last
    step's loss, whether any rank's losses since the last evaluation diverged, and the noise scale's sums of the
    step. True when the run is finished (every rank decides alike). ``every_rank``: the model's forward is a
    collective (FSDP2 all-gathers its parameters), so every rank runs the evaluation, and rank 0's counts."""
    metric = evaluate_model(workload, config, model) if ctx.is_main or every_rank else 0.0
    metric = metric if ctx.is_main else 0.0
    window = torch.stack(losses).to(torch.float64)
    last = torch.nan_to_num(window[-1], nan=0.0, posinf=0.0, neginf=0.0)
    mine = Evaluation(loss=float(last), metric=metric,
                      diverged=float(((~window.isfinite()) | (window.abs() > DIVERGED_LOSS)).any()),
                      noise_sums=tuple(sums.tolist()) if sums is not None else (0.0, 0.0))
    shared = mine.all_reduced(window)
    if sums is not None:
        _record(noise.close(sums.new_tensor(shared.noise_sums)), result)
    if shared.diverged:
        result.diverged = True
        return True
    if (steps % config.eval_every) != 0:
        return False
    result.history.append([steps, shared.loss / ctx.world_size, shared.metric])
    return settle(config, result, steps, shared.metric)


def _noise_scale(ddp, ctx: RankContext, plan: DdpPlan, config: StudyConfig, dataset_size: int, *,
                 strategy: strategies.Strategy, every_step: bool = False):
    """ddplab noise's measurement on this run (each rank's gradient against the all-reduced one), at the steps
    that end with an evaluation (at every step for AdaScale); None on one rank, which has no second batch size to
    compare, and under a strategy whose local gradients are not tapped (DeepSpeed's engine)."""
    from ddplab.noise.scale import GradientNoiseScale

    if ctx.world_size < 2 or not strategy.taps_local_gradients:
        return None
    noise = GradientNoiseScale(ddp, per_device_batch_size=plan.per_device_batch_size,
                               accumulation_steps=plan.accumulation_steps, every=1 if every_step else config.eval_every,
                               dataset_size=dataset_size)
    if not every_step:
        # Its count starts one behind: it then measures the steps the vectorized engine measures (those evaluated).
        noise.steps = 1
    return noise


def _record(estimate, result: RunResult) -> None:
    if estimate is not None:
        result.noise_g2.append(estimate.g2)
        result.noise_trace.append(estimate.trace_sigma)


def seconds_per_step(workload: workloads.Workload, config: StudyConfig, group: RunGroup,
                     device: torch.device | str = "cpu", *, steps: int = 5) -> float:
    """Seconds for one optimizer step of every run in ``group`` as one torch.optim model after another (what the
    ranks do, without their collectives), after a step of warm-up."""
    import time

    lr, seed = group.runs[0]
    dtype = torch_dtype(config)
    model = workload.model().to(dtype).to(device)
    optimizer = torch_optimizer(group.run_optimizers()[0], model.parameters(), lr)
    order = Batches(workload.train_size, group.global_batch_size, [seed])
    read = workload.batches(device, dtype)
    for step in range(steps + 1):
        if step == 1:
            synchronize(device)
            start = time.perf_counter()
        index = order.indices(step)[0].to(device)
        optimizer.zero_grad(set_to_none=True)
        workload.step_fn(model, read(index), workload.loss).backward()
        optimizer.step()
    synchronize(device)
    return (time.perf_counter() - start) / steps * len(group.runs)


class DdpEngine:
    """Each run of a group on ``world_size`` real DDP ranks, one launch per group."""

    name = "ddp"
    # The timed step leaves out the launch, the collectives and rank 0's evaluations: the DDP engine must be
    # clearly faster for fastest to leave the vectorized one (which also measures B_simple from halves and prunes).
    overhead = 1.5
    per_run = False

    def __init__(self, launch_config: LaunchConfig, *, max_per_device: int | None = None,
                 device: torch.device | str = "cpu", strategy: strategies.Strategy | None = None):
        self.launch_config, self.max_per_device, self.device = launch_config, max_per_device, torch.device(device)
        self.strategy = strategy or strategies.get()

    def train(self, workload: workloads.Workload, config: StudyConfig, group: RunGroup,
              progress: Progress | None = None) -> list[RunResult]:
        results = train_group_ddp(workload, config, group, self.launch_config, max_per_device=self.max_per_device,
                                  strategy=self.strategy)
        if progress:
            progress(config.max_steps)
        return results

    def seconds_per_step(self, workload: workloads.Workload, config: StudyConfig, group: RunGroup) -> float:
        return seconds_per_step(workload, config, group, self.device)
