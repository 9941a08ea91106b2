"""Prove that a spec trains the same on W DDP ranks as in one process, or find out why not.

The ranks train K steps with b samples each; one process trains K steps on the ranks' batches
concatenated in rank order. Both run in float64, so rounding stays far below the tolerance.
When they diverge, each suspected cause is tested by a reference run that reproduces it:
a cause is named only when that reference then matches the ranks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch

from ddplab import training
from ddplab.launch import LaunchConfig, RankContext
from ddplab.spec import Spec, load_spec

Verdict = Literal["EQUIVALENT", "DIVERGES", "STOCHASTIC", "NON_FINITE"]
EQUIVALENT, DIVERGES, STOCHASTIC, NON_FINITE = "EQUIVALENT", "DIVERGES", "STOCHASTIC", "NON_FINITE"


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

    def first_non_finite(self) -> tuple[int, int, str] | None:
        """(step, 0 for gradients or 1 for parameters, which) of the first inf or nan, else None."""
        for step, (grad, param) in enumerate(zip(self.grads, self.params)):
            for order, (what, values) in enumerate((("gradients", grad), ("parameters", param))):
                if not torch.isfinite(values).all():
                    return step, order, what
        return None

    def first(self, steps: int) -> Trajectory:
        return Trajectory(self.params[:steps], self.grads[:steps], self.used_rng)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckResult:
    config: CheckConfig
    verdict: Verdict
    cause: str | None
    explanation: str
    fix: str | None
    per_step: list[dict[str, float]]
    first_divergent_step: int | None
    has_padding: bool
    non_finite: dict[str, Any] | None = None
    """Where inf or nan first appeared: step, side ('ranks', 'single_process' or 'both') and what."""
    unused_parameters: tuple[str, ...] = ()
    """Parameters without a gradient on the first global batch."""
    find_unused_parameters: bool = False
    """Whether DDP looked for unused parameters (some parameter was unused on some step)."""

    def to_json(self) -> dict[str, Any]:
        cfg = self.config
        return {"verdict": self.verdict, "cause": self.cause, "explanation": self.explanation, "fix": self.fix,
                "tolerance": cfg.tolerance, "world_size": cfg.world_size,
                "per_device_batch_size": cfg.per_device_batch_size, "global_batch_size": cfg.global_batch_size,
                "steps": cfg.steps, "seed": cfg.seed, "first_divergent_step": self.first_divergent_step,
                "non_finite": self.non_finite, "unused_parameters": list(self.unused_parameters),
                "find_unused_parameters": self.find_unused_parameters,
                "per_step": self.per_step}


def check(cfg: CheckConfig, launch_config: LaunchConfig | None = None) -> CheckResult | None:
    """Train on the ranks, then in one process, compare, and diagnose a divergence.

    Under torchrun every rank calls this: rank 0 computes the reference and returns the
    result, the other ranks return None.
    """
    # Under torchrun the reference must split batches over torchrun's ranks, not a requested count.
    training.world_size_for(cfg.world_size, default=cfg.world_size)
    spec = load_spec(cfg.spec_path)
    # The spec's mistakes surface here, in one sentence, before any rank starts.
    facts, dataset = training.validate(spec, world_size=cfg.world_size, seed=cfg.seed, dtype=torch.float64,
                                       per_device_batch_size=cfg.per_device_batch_size)
    results, facts = training.launch_spec(_train_on_rank, launch_config or LaunchConfig(world_size=cfg.world_size),
                                          cfg, facts)
    ranks = results[0]
    if ranks is None:  # a torchrun rank other than 0
        return None
    reference = _reference(spec, dataset, cfg, "global")
    return _compare(spec, dataset, cfg, ranks, reference, facts)


def _compare(spec: Spec, dataset, cfg: CheckConfig, ranks: Trajectory, reference: Trajectory,
             facts: training.SpecFacts) -> CheckResult:
    per_step = [{**_diff(a, b), "samples_per_rank": size}
                for a, b, size in zip(ranks.params, reference.params, _samples_per_rank(len(dataset), cfg))]
    # NaN compares false: a step is equal only when its difference is a number within tolerance.
    divergent = next((i for i, d in enumerate(per_step) if not d["max_rel_diff"] <= cfg.tolerance), None)
    non_finite = _first_non_finite(ranks, reference)
    has_padding = len(dataset) % cfg.world_size != 0
    common = dict(config=cfg, per_step=per_step, first_divergent_step=divergent, has_padding=has_padding,
                  non_finite=non_finite, unused_parameters=facts.unused_parameters,
                  find_unused_parameters=facts.find_unused_parameters)
    if non_finite is not None and (divergent is None or divergent >= non_finite["step"]):
        explanation, fix = _non_finite_text(cfg, non_finite)
        return CheckResult(verdict=NON_FINITE, cause=None, explanation=explanation, fix=fix, **common)
    if divergent is None:
        return CheckResult(verdict=EQUIVALENT, cause=None, fix=None, explanation=_equivalent_text(cfg, per_step),
                           **common)
    # Diagnose on the finite steps only: references are compared to the ranks up to there.
    finite = ranks.first(non_finite["step"]) if non_finite else ranks
    verdict, cause, explanation, fix = _diagnose(spec, dataset, cfg, finite, reference, divergent, has_padding)
    if non_finite:
        explanation += (f"; from step {non_finite['step']} the {_side_text(non_finite['side'])} "
                        f"{non_finite['what']} are also not finite")
    return CheckResult(verdict=verdict, cause=cause, explanation=explanation, fix=fix, **common)


def _train_on_rank(ctx: RankContext, cfg: CheckConfig, facts: training.SpecFacts) -> Trajectory | None:
    spec = load_spec(cfg.spec_path)
    dataset = spec.dataset()
    model = training.seeded_model(spec, cfg.seed, dtype=torch.float64, device=ctx.device)
    ddp = training.wrap_ddp(model, ctx, facts)
    optimizer = spec.optimizer(ddp.parameters())
    params, grads = [], []
    for step in range(cfg.steps):
        indices = training.rank_batch(len(dataset), world_size=ctx.world_size, rank=ctx.rank, seed=cfg.seed,
                                      per_device_batch_size=cfg.per_device_batch_size, step=step)
        optimizer.zero_grad(set_to_none=True)
        loss = spec.step(ddp, training.collate(dataset, indices, ctx.device, torch.float64), spec.loss)
        with spec.guard("backward through the loss"):
            loss.backward()
        grads.append(_flat_grads(model))
        with spec.guard("the optimizer's step()"):
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
        loss = _reference_loss(spec, model, dataset, cfg, step, hypothesis)
        with spec.guard("backward through the loss"):
            loss.backward()
        used_rng = used_rng or not torch.equal(rng_before, torch.get_rng_state())
        grads.append(_flat_grads(model))
        with spec.guard("the optimizer's step()"):
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


def _samples_per_rank(dataset_size: int, cfg: CheckConfig) -> list[int]:
    """Each rank's real batch per step: smaller than --batch-size where an epoch ends in a partial batch."""
    return [len(training.rank_batch(dataset_size, world_size=cfg.world_size, rank=0, seed=cfg.seed, step=step,
                                    per_device_batch_size=cfg.per_device_batch_size)) for step in range(cfg.steps)]


def _first_non_finite(ranks: Trajectory, reference: Trajectory) -> dict[str, Any] | None:
    found = {side: trajectory.first_non_finite() for side, trajectory in
             (("ranks", ranks), ("single_process", reference))}
    found = {side: where for side, where in found.items() if where is not None}
    if not found:
        return None
    step, _, what = min(found.values())
    sides = [side for side, where in found.items() if where[0] == step]
    return {"step": step, "side": sides[0] if len(sides) == 1 else "both", "what": what}


def _side_text(side: str) -> str:
    return {"ranks": "DDP ranks'", "single_process": "single process's",
            "both": "DDP ranks' and the single process's"}[side]


def _non_finite_text(cfg: CheckConfig, where: dict[str, Any]) -> tuple[str, str]:
    step, side, what = where["step"], where["side"], where["what"]
    agreed = f"; steps 0 to {step - 1} agree" if step > 0 else ""
    if side == "both":
        return (f"from step {step} the {what} are not finite (inf or nan) on the DDP ranks and in the single process "
                f"alike: training itself overflows, so equality cannot be judged from there on{agreed}",
                "lower the learning rate, clip gradients, or guard the loss against overflow (exp of large values, "
                "log of 0, division by 0); then run ddplab check again")
    if side == "ranks":
        return (f"from step {step} the DDP ranks' {what} are not finite (inf or nan) while the single process's are: "
                f"something computed differently under DDP produces inf or nan{agreed}",
                "look for what differs on the ranks: a per-rank normalisation that can divide by 0, a rank-dependent "
                "code path, unsynchronised state")
    return (f"from step {step} the single process's {what} are not finite (inf or nan) while the DDP ranks' are: the "
            f"global batch of {cfg.global_batch_size} overflows where per-rank batches of {cfg.per_device_batch_size} "
            f"do not{agreed}",
            "lower the learning rate or guard the loss against overflow (a loss summed over the batch grows with it)")


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
                "the model draws random numbers while training (dropout or similar): every rank and the "
                "reference draw different masks, so runs cannot agree step by step and only a distributional "
                "comparison means anything",
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
            "look for state that differs between ranks: per-rank seeds, rank-dependent code paths, "
            "unsynchronised buffers")


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
