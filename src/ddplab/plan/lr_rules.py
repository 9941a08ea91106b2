"""The lr rules and Adam's settings at k× the reference's batch, each with its reason (no torch)."""

from __future__ import annotations

import math
from typing import Any

from ddplab.errors import UsageError
from ddplab.plan import scaling
from ddplab.plan.inputs import Data, Optimizer, PlanRule, Reference, RuleChoice, Target
from ddplab.plan.result import MeasuredLr
from ddplab.text import count


def choose_rule(rule: RuleChoice, optimizer: Optimizer) -> PlanRule:
    if rule != "auto":
        return rule
    return "linear" if optimizer == "sgd" else "sqrt"


def plan_lr(reference: Reference, rule: PlanRule, k: float, warnings: list[str],
            measured: MeasuredLr | None, *, keep_settings: bool = False) -> dict[str, Any]:
    """The lr, its multiplier and Adam's settings at k× the reference's global batch, each with its reason;
    ``keep_settings`` leaves Adam's betas, eps and weight decay as the reference has them."""
    _check_rule(reference, rule)
    if keep_settings and reference.optimizer == "sgd":
        raise UsageError("{target.keep_optimizer_settings} keeps Adam's betas, eps and AdamW's weight decay, and the "
                         "plan's optimizer is SGD, which has none the plan changes: drop it, or pass "
                         "{reference.optimizer} adam or adamw")
    if measured is not None:
        return _measured_lr(reference, k, warnings, measured)
    multiplier = _rule_multiplier(reference, rule, k, warnings)
    reasons = {}
    if k == 1:
        reasons["lr"] = ("the global batch is unchanged, so the gradient is the same average over the same number "
                         "of samples: keep the reference lr (DDP averages over ranks)")
    else:
        reasons["lr"] = {
            "none": f"{{target.rule}} none: the lr stays although the global batch changed ×{k:g}",
            "linear": f"linear rule (Goyal et al. 2017): lr × k = lr × {k:g}; keeps where SGD ends up, "
                      f"multiplies the variance of each update by k",
            "sqrt": f"square-root rule: lr × √k = lr × {math.sqrt(k):.4g}; keeps the variance of each update, "
                    f"needs more epochs to travel as far",
            "surge": "surge rule (Li et al. 2024, \"Surge phenomenon in optimal learning rate and batch size "
                     "scaling\"): Adam's best lr η*(B) = η_max / (½(√(B_noise/B) + √(B/B_noise))) rises up to the "
                     f"noise scale and falls past it; lr × η*(B')/η*(B) = lr × {multiplier:.4g}",
        }[rule]
    reasons["lr_multiplier"] = _multiplier_reason(rule, k, reference)
    adam = _adam(reference, rule, k, multiplier, reasons, warnings)
    if keep_settings:
        adam = _kept_settings(reference, adam, reasons)
    out = {"lr": _representable("lr", reference.lr * multiplier, "reference.lr", reference.lr, multiplier),
           "lr_multiplier": multiplier, **adam}
    if reference.optimizer == "sgd" and rule == "sqrt" and k > 1:
        warnings.append("the square-root rule keeps SGD's update variance but covers less ground per epoch: "
                        "plan on more epochs than the reference")
    return {**out, "reasons": reasons}


def _check_rule(reference: Reference, rule: PlanRule) -> None:
    """The surge rule needs Adam and a noise scale; a noise scale needs the surge rule."""
    if rule == "surge" and reference.noise_scale is None:
        raise UsageError("{target.rule} surge puts the lr's peak at the gradient noise scale: give it with "
                         "{reference.noise_scale} (ddplab noise measures it) or {from_study}")
    if rule == "surge" and reference.optimizer == "sgd":
        raise UsageError("{target.rule} surge is Adam's (Li et al. 2024): SGD's best lr does not fall past the noise "
                         "scale, so use {target.rule} linear, or pass {reference.optimizer} adam or adamw")
    if rule != "surge" and reference.noise_scale is not None:
        raise UsageError("{reference.noise_scale} is read only by {target.rule} surge: add it, or drop "
                         "{reference.noise_scale}")


def _rule_multiplier(reference: Reference, rule: PlanRule, k: float, warnings: list[str]) -> float:
    if rule != "surge":
        return scaling.lr_multiplier(k, rule)
    batches, noise = (reference.global_batch_size, reference.global_batch_size * k), reference.noise_scale
    named = (("the reference's", batches[0]),) + ((("the planned", batches[1]),) if k != 1 else ())
    far = [f"{name} global batch {batch:g}" for name, batch in named if scaling.outside_surge_range(batch, noise)]
    if far:
        warnings.append(f"{' and '.join(far)} {'lie' if len(far) > 1 else 'lies'} more than "
                        f"{scaling.SURGE_RANGE:g}× from {{reference.noise_scale}} {noise:g}: the surge rule's curve "
                        "(Li et al. 2024) is trusted near B_noise, so its lr there is an extrapolation; measure the "
                        "noise scale nearer these batches")
    return scaling.surge_lr_multiplier(*batches, noise)


def _measured_lr(reference: Reference, k: float, warnings: list[str], measured: MeasuredLr) -> dict[str, Any]:
    """The lr a study measured at this global batch; everything after (warmup, other mode) follows from it."""
    multiplier = _representable("lr", measured.lr, "reference.lr", reference.lr, 1.0) / reference.lr
    warnings.extend(measured.warnings)
    reasons = {"lr": measured.reason,
               "lr_multiplier": f"measured lr / reference lr = {measured.lr:.4g} / {reference.lr:g} "
                                f"(the global batch grew ×{k:g})"}
    adam = reference.optimizer in ("adam", "adamw")
    if adam:
        reasons["weight_decay"] = "kept as given: the measured lr replaces the rules that would rescale it"
    return {"lr": measured.lr, "lr_multiplier": multiplier, "betas": reference.betas if adam else None,
            "eps": reference.eps if adam else None, "weight_decay": reference.weight_decay, "reasons": reasons}


def _multiplier_reason(rule: str, k: float, reference: Reference) -> str:
    ratio = f"k = new global batch / reference global batch = {k:g}"
    if rule == "surge":
        batch, noise = reference.global_batch_size, reference.noise_scale
        return (f"{ratio}; the surge rule multiplies the lr by η*({batch * k:g})/η*({batch}) = "
                f"{scaling.surge_lr_factor(batch * k, noise):.4g}/{scaling.surge_lr_factor(batch, noise):.4g}, each "
                f"a fraction of the peak lr at {{reference.noise_scale}} {noise:g}")
    return {"none": f"{{target.rule}} none: the lr is not scaled, although {ratio}",
            "linear": f"{ratio}; the linear rule multiplies the lr by k",
            "sqrt": f"{ratio}; the square-root rule multiplies the lr by √k = {math.sqrt(k):.4g}"}[rule]


def _representable(name: str, value: float, field: str, reference: float, factor: float) -> float:
    """``value`` when it is a positive finite float; a sentence when the scaling overflowed or underflowed."""
    if not 0 < value < math.inf:
        raise UsageError(f"the planned {name}, {{{field}}} {reference:g} × {factor:.4g}, comes out as {value:g}, "
                         f"which no optimizer can use: check {{{field}}}")
    return value


def _adam(reference: Reference, rule: PlanRule, k: float, multiplier: float, reasons: dict[str, str],
          warnings: list[str]) -> dict[str, Any]:
    """Adam's betas, eps and weight decay at k× the reference's batch (all None for SGD)."""
    if reference.optimizer == "sgd":
        return {"betas": None, "eps": None, "weight_decay": None}
    betas, eps = reference.betas, reference.eps
    if k != 1 and rule == "none":
        reasons["betas"] = reasons["eps"] = "kept as given: {target.rule} none scales nothing"
    elif k != 1:
        betas = scaling.adam_betas(k, reference.betas)
        reasons["betas"] = _betas_reason(reference, k, betas)
        reasons["eps"] = "kept as given: ε' = ε/√k goes with the square-root rule's lr (Malladi et al. 2022)"
    if k != 1 and rule == "sqrt":
        eps = _representable("Adam eps", scaling.adam_sqrt_eps(k, eps), "reference.eps", eps, 1 / math.sqrt(k))
        reasons["eps"] = f"the square-root rule's (Malladi et al. 2022): ε' = ε/√k = ε/{math.sqrt(k):.4g}"
    elif k != 1 and rule == "linear":
        warnings.append("the linear rule is derived for SGD; Adam usually scales better with {target.rule} sqrt "
                        "(Malladi et al. 2022)")
    return {"betas": betas, "eps": eps, "weight_decay": _weight_decay(reference, rule, k, multiplier, reasons)}


def _kept_settings(reference: Reference, planned: dict[str, Any], reasons: dict[str, str]) -> dict[str, Any]:
    """The reference's betas, eps and weight decay in place of the rules' values, each saying what it left out."""
    kept = {"betas": reference.betas, "eps": reference.eps, "weight_decay": reference.weight_decay}
    for field, value in kept.items():
        if planned[field] != value:
            shown = ", ".join(f"{v:.4g}" for v in planned[field]) if field == "betas" else f"{planned[field]:.4g}"
            reasons[field] = (f"kept as given ({{target.keep_optimizer_settings}}): the rules' {shown} is not "
                              f"written")
    return kept


def _betas_reason(reference: Reference, k: float, betas: tuple[float, float]) -> str:
    (beta1, beta2), batch = reference.betas, reference.global_batch_size
    samples = scaling.half_life_steps(beta2) * batch
    return (f"β₁ kept at {beta1:g}, which works at every batch size (Marek et al. 2025, \"Small batch size training "
            f"for language models\"); β₂' = β₂^k = {beta2:g}^{k:g} = {betas[1]:.4g} keeps its half-life at "
            f"{samples:,.0f} samples (Malladi et al.'s 1 − β' = k(1 − β) to first order, never negative)")


def _weight_decay(reference: Reference, rule: PlanRule, k: float, multiplier: float, reasons: dict[str, str]) -> float:
    """λ' from the constant-timescale rule for AdamW; Adam's coupled L2 term as given."""
    decay = reference.weight_decay
    if reference.optimizer == "adam":
        reasons["weight_decay"] = ("Adam's weight decay is an L2 term in the gradient (coupled), which Adam's "
                                   "normalisation rescales: kept as given; the constant-timescale rule applies to "
                                   "AdamW's decoupled decay ({reference.optimizer} adamw)")
        return decay
    if decay == 0 or rule == "none" or k == 1:
        why = ("no decay to rescale" if decay == 0 else "{target.rule} none scales nothing" if rule == "none"
               else "the global batch and lr are unchanged")
        reasons["weight_decay"] = f"kept as given: {why}"
        return decay
    reasons["weight_decay"] = (f"AdamW's weights average over 1/(η·λ) steps; keeping that timescale constant in "
                               f"epochs (Wang & Aitchison 2024; Bergsma et al. 2025, \"Power Lines\") gives "
                               f"λ' = λ·(B'/B)·(η/η') = {decay:g} × {k:g} / {multiplier:.4g}")
    return scaling.adamw_weight_decay(decay, batch_ratio=k, lr_ratio=multiplier)


def adamw_timescale(reference: Reference, data: Data, global_batch: int, lr_fields: dict[str, Any],
                     reasons: dict[str, str]) -> dict[str, Any]:
    """AdamW's averaging timescale in epochs, τ = B/(η·λ·N), with the reference's beside it, and in steps, 1/(η·λ),
    which needs no dataset size."""
    lr, decay = lr_fields["lr"], lr_fields["weight_decay"]
    if reference.optimizer != "adamw" or not decay:
        return {"adamw_timescale_epochs": None, "adamw_timescale_steps": None}
    steps = scaling.adamw_timescale_steps(lr=lr, weight_decay=decay)
    if data.dataset_size is None:
        reasons["weight_decay"] += (f"; the weights average over 1/(η·λ) = {steps:,.0f} steps (pass "
                                    "{data.dataset_size} for epochs)")
        return {"adamw_timescale_epochs": None, "adamw_timescale_steps": steps}
    n = data.dataset_size
    epochs = scaling.adamw_timescale_epochs(lr=lr, weight_decay=decay, global_batch_size=global_batch, dataset_size=n)
    was = scaling.adamw_timescale_epochs(lr=reference.lr, weight_decay=reference.weight_decay,
                                         global_batch_size=reference.global_batch_size, dataset_size=n)
    same = math.isclose(epochs, was, rel_tol=1e-9)
    reasons["adamw_timescale_epochs"] = (f"B/(η·λ·N) = {global_batch}/({lr:.4g} × {decay:.4g} × {n}): the weights "
                                         f"average over the last {steps:,.0f} steps"
                                         + ("; the reference's too" if same else f"; the reference's: {was:.4g}"))
    return {"adamw_timescale_epochs": epochs, "adamw_timescale_steps": steps}


def world_size_overshoot(reference: Reference, target: Target, rule: PlanRule, k: float, multiplier: float) -> str:
    """What counting every rank instead of the data-parallel ones would have done to the lr."""
    by_world = k * target.model_parallel_size / reference.model_parallel_size
    wrong = scaling.lr_multiplier(by_world, rule)
    direction = "too high" if wrong > multiplier else "too low"
    return (f"; k counts data-parallel ranks: counting all {count(target.world_size, 'rank')} would make k "
            f"{by_world:g} and the lr ×{wrong:.4g}, {wrong / multiplier:.4g}× {direction}")
