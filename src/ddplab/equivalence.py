"""Prove that a spec trains the same on W DDP ranks as in one process, or find out why not.

The ranks train K steps with b samples each; one process trains K steps on the ranks' batches
concatenated in rank order. Both run in float64, so rounding stays far below the tolerance.
When they diverge, each suspected cause is tested by a reference run that reproduces it:
a cause is named only when that reference then matches the ranks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ddplab import training
from ddplab.launch import LaunchConfig, RankContext, launch
from ddplab.spec import Spec, load_spec

EQUIVALENT, DIVERGES, STOCHASTIC = "EQUIVALENT", "DIVERGES", "STOCHASTIC"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckConfig:
    """One ``ddplab check`` run."""

    spec_path: str
    world_size: int
    per_device_batch_size: int
    steps: int
    seed: int = 0
    tolerance: float = 1e-9
    """Largest parameter difference, relative to the largest parameter, still called equal."""

    def __post_init__(self):
        for flag, value in (("--world-size", self.world_size), ("--batch-size", self.per_device_batch_size),
                            ("--steps", self.steps)):
            if value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        if not self.tolerance > 0:
            raise ValueError(f"--tolerance must be positive, got {self.tolerance}")

    @property
    def global_batch_size(self) -> int:
        return self.per_device_batch_size * self.world_size


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """Flattened float64 parameters after each step and gradients before it."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    used_rng: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckResult:
    config: CheckConfig
    verdict: str
    cause: str | None
    explanation: str
    fix: str | None
    per_step: list[dict[str, float]]
    first_divergent_step: int | None
    has_padding: bool

    def to_json(self) -> dict[str, Any]:
        cfg = self.config
        return {"verdict": self.verdict, "cause": self.cause, "explanation": self.explanation, "fix": self.fix,
                "tolerance": cfg.tolerance, "world_size": cfg.world_size,
                "per_device_batch_size": cfg.per_device_batch_size, "global_batch_size": cfg.global_batch_size,
                "steps": cfg.steps, "seed": cfg.seed, "first_divergent_step": self.first_divergent_step,
                "per_step": self.per_step}


def check(cfg: CheckConfig, launch_config: LaunchConfig | None = None) -> CheckResult:
    """Train on the ranks, then in one process, compare, and diagnose a divergence."""
    spec = load_spec(cfg.spec_path)
    ranks = launch(_train_on_rank, launch_config or LaunchConfig(world_size=cfg.world_size), cfg)[0]
    dataset = spec.dataset()
    reference = _reference(spec, dataset, cfg, "global")
    per_step = [_diff(a, b) for a, b in zip(ranks.params, reference.params)]
    divergent = next((i for i, d in enumerate(per_step) if d["max_rel_diff"] > cfg.tolerance), None)
    has_padding = len(dataset) % cfg.world_size != 0
    common = dict(config=cfg, per_step=per_step, first_divergent_step=divergent, has_padding=has_padding)
    if divergent is None:
        return CheckResult(verdict=EQUIVALENT, cause=None, fix=None, explanation=_equivalent_text(cfg, per_step), **common)
    verdict, cause, explanation, fix = _diagnose(spec, dataset, cfg, ranks, reference, divergent, has_padding)
    return CheckResult(verdict=verdict, cause=cause, explanation=explanation, fix=fix, **common)


def _train_on_rank(ctx: RankContext, cfg: CheckConfig) -> Trajectory | None:
    from torch.nn.parallel import DistributedDataParallel

    spec = load_spec(cfg.spec_path)
    dataset = spec.dataset()
    model = training.seeded_model(spec, cfg.seed, dtype=torch.float64, device=ctx.device)
    ddp = DistributedDataParallel(model, device_ids=ctx.device_ids)
    optimizer = spec.optimizer(ddp.parameters())
    params, grads = [], []
    for step in range(cfg.steps):
        indices = training.rank_batch(len(dataset), world_size=ctx.world_size, rank=ctx.rank, seed=cfg.seed,
                                      per_device_batch_size=cfg.per_device_batch_size, step=step)
        optimizer.zero_grad(set_to_none=True)
        spec.step(ddp, training.collate(dataset, indices, ctx.device, torch.float64), spec.loss).backward()
        grads.append(_flat_grads(model))
        optimizer.step()
        params.append(_flat_params(model))
    return Trajectory(params, grads) if ctx.is_main else None


def _reference(spec: Spec, dataset, cfg: CheckConfig, hypothesis: str) -> Trajectory:
    """One process on the concatenated batches; ``hypothesis`` reproduces a suspected cause.

    'global': the plain single-process run. 'padding': keep DistributedSampler's repeated
    samples. 'per-rank': average W per-rank losses, each over its own rank's batch, as DDP does.
    """
    model = training.seeded_model(spec, cfg.seed, dtype=torch.float64)
    optimizer = spec.optimizer(model.parameters())
    params, grads, used_rng = [], [], False
    for step in range(cfg.steps):
        optimizer.zero_grad(set_to_none=True)
        rng_before = torch.get_rng_state()
        _reference_loss(spec, model, dataset, cfg, step, hypothesis).backward()
        used_rng = used_rng or not torch.equal(rng_before, torch.get_rng_state())
        grads.append(_flat_grads(model))
        optimizer.step()
        params.append(_flat_params(model))
    return Trajectory(params, grads, used_rng)


def _reference_loss(spec: Spec, model, dataset, cfg: CheckConfig, step: int, hypothesis: str) -> torch.Tensor:
    size, world, batch = len(dataset), cfg.world_size, cfg.per_device_batch_size
    if hypothesis == "per-rank":
        losses = [spec.step(model, training.collate(dataset, training.rank_batch(
            size, world_size=world, rank=rank, per_device_batch_size=batch, seed=cfg.seed, step=step),
            torch.device("cpu"), torch.float64), spec.loss) for rank in range(world)]
        return sum(losses) / world
    indices = training.reference_batch(size, world_size=world, per_device_batch_size=batch, seed=cfg.seed, step=step,
                                       keep_padding=hypothesis == "padding")
    return spec.step(model, training.collate(dataset, indices, torch.device("cpu"), torch.float64), spec.loss)


def _flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


def _flat_grads(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).cpu()
                      for p in model.parameters()])


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    max_abs = (a - b).abs().max().item() if a.numel() else 0.0
    scale = b.abs().max().item() if b.numel() else 0.0
    return {"max_abs_diff": max_abs, "max_rel_diff": max_abs / scale if scale > 0 else max_abs}


def _matches(ranks: Trajectory, reference: Trajectory, tolerance: float) -> bool:
    return all(_diff(a, b)["max_rel_diff"] <= tolerance for a, b in zip(ranks.params, reference.params))


def _diagnose(spec: Spec, dataset, cfg: CheckConfig, ranks: Trajectory, reference: Trajectory, step: int,
              has_padding: bool):
    world = cfg.world_size
    if reference.used_rng:
        return (STOCHASTIC, "RANDOMNESS",
                "the model draws random numbers while training (dropout or similar): every rank and the reference draw "
                "different masks, so runs cannot agree step by step and only a distributional comparison means anything",
                "to check everything else exactly, set dropout to p=0 in the spec (or call .eval() on the dropout "
                "modules only) and run ddplab check again; compare loss curves over several seeds for the rest")
    ratio = _gradient_ratio(reference.grads[step], ranks.grads[step])
    if ratio is not None and abs(ratio - world) <= 1e-6 * world and world > 1:
        return (DIVERGES, "SUM_REDUCTION",
                f"from step {step} the ranks' gradient is exactly 1/{world} of the single-process gradient: the loss "
                f"is summed over the batch, and DDP averages the {world} per-rank sums",
                f"use reduction='mean', or multiply the loss by the world size ({world}) under DDP")
    if ratio is not None and abs(ratio - round(ratio)) <= 1e-6 * abs(ratio) and round(ratio) not in (0, 1):
        factor = round(ratio)
        return (DIVERGES, "GRADIENT_SCALE",
                f"from step {step} the gradients differ by exactly a factor of {factor}: typically a loss summed over "
                f"{factor} accumulation micro-steps and not divided by their count",
                f"divide each micro-step's loss by the number of accumulation steps ({factor})")
    if has_padding and _matches(ranks, _reference(spec, dataset, cfg, "padding"), cfg.tolerance):
        return (DIVERGES, "PADDING",
                f"the dataset of {len(dataset)} samples does not split evenly over {world} ranks, so "
                "DistributedSampler repeats samples to pad the last batches: confirmed by a reference that trains on "
                "the same repeats",
                "make the dataset size a multiple of the world size, or use DistributedSampler(drop_last=True) and "
                "accept dropping the tail")
    if _matches(ranks, _reference(spec, dataset, cfg, "per-rank"), cfg.tolerance):
        if _has_batchnorm(spec):
            return (DIVERGES, "BATCHNORM",
                    f"BatchNorm normalises each rank's {cfg.per_device_batch_size} samples with their own statistics, "
                    f"not the global batch's {cfg.global_batch_size}: confirmed by a reference that reproduces "
                    "per-rank statistics and then matches",
                    "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) computes global statistics (it needs GPUs "
                    "with NCCL); or accept per-rank statistics, common practice when the per-rank batch is large")
        return (DIVERGES, "PER_RANK_LOSS",
                "the loss depends on how the global batch is split across ranks (e.g. normalised by a per-rank count): "
                "confirmed by a reference that averages per-rank losses",
                "normalise the loss by a global count (all-reduce it) or by a constant")
    return (DIVERGES, "UNKNOWN",
            f"parameters first differ at step {step} and no tested cause (randomness, gradient scale, padding, "
            "per-rank statistics) reproduces the difference",
            "look for state that differs between ranks: per-rank seeds, rank-dependent code paths, unsynchronised buffers")


def _gradient_ratio(single: torch.Tensor, ranks: torch.Tensor) -> float | None:
    """c when ``single`` = c·``ranks`` up to rounding, else None."""
    norm = ranks.dot(ranks)
    if norm == 0:
        return None
    ratio = (single.dot(ranks) / norm).item()
    residual = (single - ratio * ranks).norm() / single.norm().clamp_min(1e-300)
    return ratio if residual.item() <= 1e-8 else None


def _has_batchnorm(spec: Spec) -> bool:
    from torch.nn.modules.batchnorm import _BatchNorm

    return any(isinstance(m, _BatchNorm) for m in spec.model().modules())


def _equivalent_text(cfg: CheckConfig, per_step: list[dict[str, float]]) -> str:
    worst = max(d["max_rel_diff"] for d in per_step)
    return (f"{cfg.world_size} ranks × {cfg.per_device_batch_size} and one process with {cfg.global_batch_size} agree "
            f"after every one of {cfg.steps} steps (largest relative difference {worst:.1e} ≤ {cfg.tolerance:g})")
