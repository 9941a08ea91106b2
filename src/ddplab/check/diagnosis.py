"""Why the ranks and the single process diverged: each cause named only when a reference reproducing it matches.

The verdict's words live here too, so the check's whole explanation reads in one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import torch

from ddplab.check.config import CheckConfig
from ddplab.check.result import Cause, Verdict

Hypothesis = Literal["global", "padding", "per-rank", "per-micro-batch", "divide-factor", "rounding", "unused-zero"]


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    verdict: Verdict
    cause: Cause
    explanation: str
    fix: str


def diagnose(spec, dataset_size: int, cfg: CheckConfig, ranks, single, step: int, has_padding: bool,
             rerun: Callable[[Hypothesis], Any], unused: tuple[str, ...] = ()) -> Diagnosis:
    """The first cause whose evidence holds: randomness, an exact gradient factor, or a matching reference."""
    world = cfg.world_size
    if single.used_rng:
        return Diagnosis(
            "STOCHASTIC", "RANDOMNESS",
            "the model draws random numbers while training (dropout or similar): every rank and the reference draw "
            "different masks, so runs cannot agree step by step and only a distributional comparison means anything",
            "to check everything else exactly, set dropout to p=0 in the spec (or call .eval() on the dropout "
            "modules only) and run ddplab check again; compare loss curves over several seeds for the rest")
    # The ranks' reduction divided by something else than their count: a reference scaled alike must then match.
    factors = ranks.divide_factors - {float(world)}
    if len(ranks.divide_factors) == 1 and factors and ranks.matches(rerun("divide-factor"), cfg.tolerance):
        return _divide_factor(cfg, step, next(iter(factors)))
    fractions = ranks.reduction_error_of_bound()
    if fractions is not None and max(fractions) <= 1:
        rounded = rerun("rounding")
        if ranks.matches(rounded, cfg.tolerance):
            return _rounding(cfg, max(fractions), ranks.largest_difference(rounded))
    fit = scaled_fit(single.grads[step], ranks.grads[step])
    # Each micro-batch's loss is divided by the accumulation steps: a sum then ends W·K times too small.
    if world > 1 and fit is not None and _summed(fit, world * cfg.accumulation_steps):
        return _sum_reduction(cfg, step, fit)
    ratio = gradient_ratio(single.grads[step], ranks.grads[step])
    if ratio is not None and abs(ratio - round(ratio)) <= 1e-6 * abs(ratio) and round(ratio) not in (0, 1):
        factor = round(ratio)
        return Diagnosis(
            "DIVERGES", "GRADIENT_SCALE",
            f"from step {step} the gradients differ by exactly a factor of {factor}: typically a loss summed over "
            f"{factor} accumulation micro-steps and not divided by their count",
            f"divide each micro-step's loss by the number of accumulation steps ({factor})")
    if has_padding and ranks.matches(rerun("padding"), cfg.tolerance):
        return Diagnosis(
            "DIVERGES", "PADDING",
            f"the dataset of {dataset_size} samples does not split evenly over {world} ranks, so DistributedSampler "
            "repeats samples to pad the last batches: confirmed by a reference that trains on the same repeats",
            "make the dataset size a multiple of the world size, or use DistributedSampler(drop_last=True) and "
            "accept dropping the tail")
    if cfg.accumulation_steps > 1 and ranks.matches(rerun("per-micro-batch"), cfg.tolerance):
        return _per_rank_cause(spec, cfg, per_micro_batch=True)
    if ranks.matches(rerun("per-rank"), cfg.tolerance):
        return _per_rank_cause(spec, cfg)
    # Only DeepSpeed's engine fills in a zero gradient for them; DDP and FSDP2 leave them without one.
    if unused and cfg.strategy == "deepspeed" and ranks.matches(rerun("unused-zero"), cfg.tolerance):
        return _unused_stepped(cfg, unused)
    if factors:
        shown = ", ".join(f"{factor:g}" for factor in sorted(ranks.divide_factors))
        return Diagnosis(
            "DIVERGES", "DIVIDE_FACTOR",
            f"parameters first differ at step {step}, and the ranks' FSDP groups divide their summed gradients by "
            f"{shown} where an average over {world} ranks divides by {world} (set_gradient_divide_factor); no "
            "reference reproduces the difference, so it may have more causes than this",
            f"remove the set_gradient_divide_factor calls (FSDP2 then divides by the data-parallel size, {world})")
    return Diagnosis(
        "DIVERGES", "UNKNOWN",
        f"parameters first differ at step {step} and no tested cause (randomness, gradient scale, padding, "
        "per-rank statistics) reproduces the difference",
        "look for state that differs between ranks: per-rank seeds, rank-dependent code paths, unsynchronised buffers")


UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8}
"""Half the gap between 1 and the next number of each reduce_dtype: the largest relative error of one rounding."""


def reduction_rounding_bound(reduce_dtype: str, data_parallel_size: int) -> float:
    """γ with |reduced − exact average| ≤ γ · mean |local gradient|, elementwise, for a reduction in ``reduce_dtype``.

    W local gradients each rounded once to the reduce dtype (u), summed with W − 1 roundings, each at most u
    times a partial sum of magnitudes, then divided (at most twice, HSDP's reduce-scatter and all-reduce): at
    most (W + 2)·u·Σ|g_i| / W. Higham's γ_n = n·u / (1 − n·u) covers the second-order terms.
    """
    n_u = (data_parallel_size + 2) * UNIT_ROUNDOFF[reduce_dtype]
    return n_u / (1 - n_u)


# How far from an exact 1/W a summed loss's gradients may be. A term that does not grow with the batch (an L2
# penalty added in step()) is averaged by DDP, not summed: the gradients are then W apart only up to that term,
# which is small beside a loss summed over a batch; a cause of another kind leaves them nowhere near W apart.
SUM_TOLERANCE = 0.05


def _summed(fit: tuple[float, float], world: int) -> bool:
    ratio, residual = fit
    return abs(ratio - world) <= SUM_TOLERANCE * world and residual <= SUM_TOLERANCE


SAMPLE_NORMALISERS = ("reduction='mean', or the sum divided by len(target) × a constant (for a token loss, the "
                      "maximum length)")
"""What a spec's loss() can divide by so that W ranks and one process on the global batch agree."""


def _sum_reduction(cfg: CheckConfig, step: int, fit: tuple[float, float]) -> Diagnosis:
    ratio, residual = fit
    world, label = cfg.world_size, strategy_label(cfg)
    factor = world * cfg.accumulation_steps
    cause = (f"the loss is summed over the batch (or divided by a number fixed in advance), and {label} averages the "
             f"{world} per-rank sums")
    measured = f"1/W with W = {world} ranks"
    if cfg.accumulation_steps > 1:
        cause += f" of {cfg.accumulation_steps} micro-batches, each divided by {cfg.accumulation_steps}"
        measured = f"1/(W·K) with W = {world} ranks and K = {cfg.accumulation_steps} micro-batches"
    # loss() also computes the reference: only a normaliser that follows the samples it is given can match.
    unchanged = (f"a fixed divisor or a factor of the world size changes nothing, since the single-process reference "
                 f"runs the same loss() on the global batch of {cfg.global_batch_size}")
    # A reduction in a lower dtype leaves its rounding in the gradients: exact up to that.
    rounding = reduction_rounding_bound(cfg.reduce_dtype, world) if cfg.reduce_dtype else 0.0
    if abs(ratio - factor) <= max(1e-6, rounding) * factor and residual <= max(1e-8, rounding):
        exactly = f", up to {cfg.reduce_dtype}'s rounding," if cfg.reduce_dtype else " exactly"
        return Diagnosis(
            "DIVERGES", "SUM_REDUCTION",
            f"from step {step} the ranks' gradient is{exactly} 1/{factor} of the single-process gradient "
            f"({measured}): {cause}",
            f"make loss() normalise by the samples it is given: {SAMPLE_NORMALISERS}; {unchanged}")
    return Diagnosis(
        "DIVERGES", "SUM_REDUCTION",
        f"from step {step} the ranks' gradient is 1/{factor} of the single-process gradient ({measured}) but for a "
        f"small part ({residual:.2g} of its norm) that does not grow with the batch, such as a weight penalty added "
        f"to the loss: {cause}",
        f"make the summed part of loss() normalise by the samples it is given ({SAMPLE_NORMALISERS}) and rescale the "
        f"penalty to match; {unchanged}")


def _divide_factor(cfg: CheckConfig, step: int, factor: float) -> Diagnosis:
    world = cfg.world_size
    return Diagnosis(
        "DIVERGES", "DIVIDE_FACTOR",
        f"from step {step} the ranks' gradients are {world / factor:g} times the single process's: the spec sets "
        f"FSDP2's gradient divide factor to {factor:g} (set_gradient_divide_factor), so the reduction divides the sum "
        f"of the {world} ranks' gradients by {factor:g} instead of averaging them: confirmed by a reference whose "
        f"gradients are scaled by {world / factor:g} ({world}/{factor:g}) and then matches",
        f"remove the set_gradient_divide_factor call (FSDP2 then divides by the data-parallel size, {world}), or "
        f"set it to {world}; with a loss summed over the batch, a factor of 1 is what makes it match one process")


def _rounding(cfg: CheckConfig, of_bound: float, matched: float) -> Diagnosis:
    dtype = cfg.reduce_dtype
    return Diagnosis(
        "ROUNDING", "REDUCE_PRECISION",
        f"the ranks reduce their gradients in {dtype} (reduce_dtype) while the parameters are float64: at every step "
        f"the reduced gradient is within {dtype}'s rounding bound of the exact float64 average of the ranks' local "
        f"gradients (at most {of_bound:.2f} of the bound), and a single process given the same rounding matches "
        f"the ranks to {matched:.1e}: the difference is the reduction's rounding, not a mistake",
        None)


def _per_rank_cause(spec, cfg: CheckConfig, per_micro_batch: bool = False) -> Diagnosis:
    part = (f"micro-batch of {cfg.per_device_batch_size}" if per_micro_batch
            else f"rank's {cfg.rank_step_batch_size} samples")
    if _has_batchnorm(spec):
        return Diagnosis(
            "DIVERGES", "BATCHNORM",
            f"BatchNorm normalises each {part} with their own statistics, not the global batch's "
            f"{cfg.global_batch_size}: confirmed by a reference that reproduces per-{_unit(per_micro_batch)} "
            "statistics and then matches",
            "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) computes global statistics (it needs GPUs with "
            "NCCL); or accept per-rank statistics, common practice when the per-rank batch is large")
    if per_micro_batch:
        return Diagnosis(
            "DIVERGES", "LOSS_NORMALISED_PER_MICRO_BATCH",
            f"the loss of each {part} is normalised by a count of its own (tokens, positives), and the "
            f"{cfg.accumulation_steps} micro-batches' means are then averaged: not the mean over the step's elements. "
            "Confirmed by a reference that averages per-micro-batch losses and then matches",
            "divide the summed loss by the step's count, summed over its micro-batches and all-reduced over the "
            "data-parallel ranks, times the data-parallel size (or by len(target) × a constant such as the maximum "
            f"length){_engine_recipe(cfg)}; see the token-level losses page")
    return Diagnosis(
        "DIVERGES", "LOSS_NORMALISED_PER_DEVICE",
        f"the loss of each {part} is normalised by a count of its own (tokens, positives), and "
        f"{strategy_label(cfg)} averages the {cfg.world_size} ranks' means: not the mean over the global batch's "
        "elements. Confirmed by a reference that averages per-rank losses and then matches",
        "divide the summed loss by the count all-reduced over the data-parallel ranks (and summed over the step's "
        "micro-batches), times the data-parallel size; or by len(target) × a constant such as the maximum length"
        f"{_engine_recipe(cfg)}; see the token-level losses page")


def _unused_stepped(cfg: CheckConfig, unused: tuple[str, ...]) -> Diagnosis:
    names = ", ".join(unused[:5]) + (" …" if len(unused) > 5 else "")
    return Diagnosis(
        "DIVERGES", "UNUSED_PARAMETERS_STEPPED",
        f"the forward does not use {names}: one process leaves them without a gradient, so the optimizer skips "
        f"them, while {strategy_label(cfg)} gives them a zero gradient (DeepSpeed's engine fills one in to reduce "
        "equal sizes; at ZeRO-3 a parameter unused on some steps only keeps its last one), so weight decay and "
        "momentum move them. Confirmed by a reference that gives them zero gradients and then matches",
        "set requires_grad=False on the unused parameters (at ZeRO 0-2 leaving them out of the optimizer does too; "
        "ZeRO-3 needs every parameter in it), or train them without weight decay and momentum")


def _engine_recipe(cfg: CheckConfig) -> str:
    """DeepSpeed's form of the global-count fix: its backward divides by the accumulation steps unless told not to."""
    if cfg.strategy != "deepspeed":
        return ""
    return ("; under DeepSpeed's engine, which divides every loss by gradient_accumulation_steps itself, "
            "engine.backward(loss_sum * dp_size / count, scale_wrt_gas=False)")


def _unit(per_micro_batch: bool) -> str:
    return "micro-batch" if per_micro_batch else "rank"


def gradient_ratio(single: torch.Tensor, ranks: torch.Tensor) -> float | None:
    """c when ``single`` = c·``ranks`` up to rounding, else None."""
    fit = scaled_fit(single, ranks)
    return fit[0] if fit is not None and fit[1] <= 1e-8 else None


def scaled_fit(single: torch.Tensor, ranks: torch.Tensor) -> tuple[float, float] | None:
    """(c, r): the least-squares c in ``single`` ≈ c·``ranks``, and what c·``ranks`` leaves of ``single``,
    relative to its norm; None when ``ranks`` is zero."""
    norm = ranks.dot(ranks)
    if norm == 0:
        return None
    ratio = (single.dot(ranks) / norm).item()
    residual = (single - ratio * ranks).norm() / single.norm().clamp_min(1e-300)
    return ratio, residual.item()


def _has_batchnorm(spec) -> bool:
    from torch.nn.modules.batchnorm import _BatchNorm

    return any(isinstance(m, _BatchNorm) for m in spec.model().modules())


def equivalent_text(cfg: CheckConfig, per_step: list[dict[str, float]]) -> str:
    worst = max(d["max_rel_diff"] for d in per_step)
    ranks = f"{cfg.world_size} rank{'s' if cfg.world_size != 1 else ''}"
    return (f"{ranks} × {_per_rank_batch(cfg)} and one process with {cfg.global_batch_size} agree "
            f"after every one of {cfg.steps} steps (largest relative difference {worst:.1e} ≤ {cfg.tolerance:g})")


def _per_rank_batch(cfg: CheckConfig) -> str:
    """A rank's samples per step as the texts write it: 8, or 4 micro-batches of 8."""
    if cfg.accumulation_steps == 1:
        return str(cfg.per_device_batch_size)
    return f"{cfg.accumulation_steps} micro-batches of {cfg.per_device_batch_size}"


def strategy_label(cfg: CheckConfig) -> str:
    """How the texts name the ranks' strategy: DDP, FSDP, HSDP, DeepSpeed ZeRO-2."""
    return cfg.strategy_text(cfg.world_size) if cfg.strategy == "deepspeed" else cfg.strategy.upper()


def one_rank_note(cfg: CheckConfig) -> str | None:
    """On one rank DDP averages nothing: the check then compares its wrapper with the plain model, nothing more."""
    if cfg.world_size != 1:
        return None
    return (f"one rank: this compares {strategy_label(cfg)}'s wrapper with the plain model, not ranks against each "
            "other, so it cannot show what changes with several ranks (a summed loss, padding, per-rank statistics); "
            "check with a world size of 2 or more for that")


def side_text(cfg: CheckConfig, side: str) -> str:
    label = strategy_label(cfg)
    return {"ranks": f"{label} ranks'", "single_process": "single process's",
            "both": f"{label} ranks' and the single process's"}[side]


def non_finite_text(cfg: CheckConfig, where: dict[str, Any]) -> tuple[str, str]:
    step, side, what, label = where["step"], where["side"], where["what"], strategy_label(cfg)
    agreed = f"; steps 0 to {step - 1} agree" if step > 0 else ""
    if side == "both":
        return (f"from step {step} the {what} are not finite (inf or nan) on the {label} ranks and in the single "
                f"process alike: training itself overflows, so equality cannot be judged from there on{agreed}",
                "lower the learning rate, clip gradients, or guard the loss against overflow (exp of large values, "
                "log of 0, division by 0); then run ddplab check again")
    if side == "ranks":
        return (f"from step {step} the {label} ranks' {what} are not finite (inf or nan) while the single process's "
                f"are: something computed differently under {label} produces inf or nan{agreed}",
                "look for what differs on the ranks: a per-rank normalisation that can divide by 0, a rank-dependent "
                "code path, unsynchronised state")
    return (f"from step {step} the single process's {what} are not finite (inf or nan) while the {label} ranks' are: "
            f"the global batch of {cfg.global_batch_size} overflows where per-rank batches of "
            f"{cfg.per_device_batch_size} do not{agreed}",
            "lower the learning rate or guard the loss against overflow (a loss summed over the batch grows with it)")
