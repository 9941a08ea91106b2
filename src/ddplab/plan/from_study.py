"""Plan from what ``ddplab study`` measured: its best lr at the planned global batch and its fitted B_crit.

The measured lr replaces the rule *before* the rest of the plan is reasoned, so the warmup, its
reason and the other mode all follow from the lr the plan recommends (pure Python, no torch).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from ddplab.errors import UsageError, literal, render
from ddplab.plan import planner, scaling
from ddplab.plan.from_branches import is_branched, plan_from_branches
from ddplab.plan.reported import Reported, positive_whole


def plan_from_study(reference: planner.Reference | Mapping[str, Any], target: planner.Target,
                    data: planner.Data | None, study: str | dict, *,
                    names: Mapping[str, str] | None = None) -> planner.Plan:
    """:func:`ddplab.plan.plan` with the study's B_crit and its best lr at the planned global batch.

    ``study`` is a study.json path or its loaded dict; ``names`` as for :func:`~ddplab.plan.plan`;
    ``reference`` a Reference, or the fields given for it (flags), which the study's reference completes (its global
    batch, lr and optimizer) and is checked against, a warning per contradiction.
    UsageError when the study has no tuned curve, was measured with another optimizer family, or
    ``data`` already gives a critical batch size. With ``target.rule`` surge only the study's B_simple is read,
    as the rule's noise scale. A critical-batch measurement (``branched.json``) gives its last resolved checkpoint's
    critical batch instead, and the lr follows the rule (:mod:`ddplab.plan.from_branches`).
    """
    data = data or planner.Data()
    loaded = read_study(study)
    contradictions: tuple[str, ...] = ()
    source = study if isinstance(study, str) else "the study"
    if not isinstance(reference, planner.Reference):
        reference, contradictions = reported_study(source, loaded).merge(reference)
    if is_branched(loaded):
        if target.rule == "surge":
            raise UsageError("{target.rule} surge needs a noise scale, which a critical-batch measurement "
                             "(branched.json) does not give: plan from a grid study's study.json, or pass "
                             "{reference.noise_scale}")
        return plan_from_branches(reference, target, data, loaded, source, names=names, before=contradictions)
    if target.rule == "surge":
        # The surge rule takes only B_noise from the study: its lr comes from the rule, not the tuned curve.
        result = planner.plan(_with_noise_scale(reference, loaded), target, data, names=names)
        return _warned(result, names, before=contradictions)
    loaded = load_study(loaded)
    if data.critical_batch_size is not None:
        raise UsageError("{data.critical_batch_size} and {from_study} both give the critical batch size: drop "
                         "{data.critical_batch_size}, the study's measured B_crit is used")
    if target.rule != "auto":
        raise UsageError(f"{{target.rule}} {target.rule} and {{from_study}} both choose the lr: drop {{target.rule}}, "
                         "the study's best lr at the planned global batch replaces any rule")
    _check_optimizer(reference, loaded)
    b_crit, bound = _b_crit(loaded), _bound(loaded)
    source = StudyLr(loaded)
    result = planner.plan(reference, target, dataclasses.replace(data, critical_batch_size=b_crit), lr_source=source,
                          names=names)
    return _warned(result, names, before=contradictions, after=(*bound, *_reference_lr_mismatch(reference, source)))


def _warned(result: planner.Plan, names: Mapping[str, str] | None, *, before: tuple[str, ...] = (),
            after: tuple[str, ...] = ()) -> planner.Plan:
    """The plan with more warnings (templates, in ``names``' words): the reference's contradictions before its own."""
    if not before and not after:
        return result
    first, last = (tuple(render(warning, names) for warning in warnings) for warnings in (before, after))
    return dataclasses.replace(result, warnings=first + result.warnings + last)


def reported_study(source: str, study: Mapping[str, Any]) -> Reported:
    """The study's reference as Reference fields: its global batch and lr, and its optimizer where it is one the
    plan scales (Adam's settings with it)."""
    fields: dict[str, Any] = {}
    reference = study.get("reference") if isinstance(study.get("reference"), dict) else {}
    batch = positive_whole(source, reference, "global_batch_size")
    if batch is not None:
        fields["global_batch_size"] = batch
    if isinstance(reference.get("lr"), (int, float)) and reference["lr"] > 0:
        fields["lr"] = float(reference["lr"])
    optimizer = study.get("optimizer") if isinstance(study.get("optimizer"), dict) else {}
    if optimizer.get("family") in ("sgd", "adam", "adamw"):
        fields["optimizer"] = optimizer["family"]
    if optimizer.get("family") in ("adam", "adamw"):
        if isinstance(optimizer.get("betas"), list) and len(optimizer["betas"]) == 2:
            fields["betas"] = tuple(optimizer["betas"])
        fields |= {name: optimizer[name] for name in ("eps", "weight_decay")
                   if isinstance(optimizer.get(name), (int, float))}
    return Reported(source=source, fields=fields)


def own_workload(study: Mapping[str, Any]) -> bool:
    """Whether the study trained the user's own training (a spec file, which the study names by its file name), not
    one of ddplab's built-in workloads."""
    return str(study.get("workload", "")).endswith(".py")


def _reference_lr_mismatch(reference: planner.Reference, source: StudyLr) -> tuple[str, ...]:
    """A warning when the study's best lr at the reference's own batch is far from the lr the reference trusts."""
    measured = source(reference.global_batch_size).lr
    ratio = reference.lr / measured
    if 0.5 <= ratio <= 2:
        return ()
    away = (f"the study's best lr at the reference's global batch {reference.global_batch_size} is {measured:.4g}, "
            f"{max(ratio, 1 / ratio):.3g}× away from {{reference.lr}} {reference.lr:g}")
    if own_workload(source.study):
        return (f"{away}: the study trained your own spec ({literal(source.study['workload'])}), so the reference "
                "lr is not its best there; the planned lr follows the study's best lrs, not the reference's",)
    return (f"{away}: the study's workload may not behave like yours, so its lrs may not transfer; study your own "
            "training (a spec file) to be sure",)


@dataclasses.dataclass(frozen=True)
class StudyLr:
    """The tuned curve's best lr at a global batch, interpolated log-log between measured batches."""

    study: dict

    def __call__(self, global_batch_size: int) -> planner.MeasuredLr:
        tuned = self.study["tuned_lr"]
        batches = [p["global_batch_size"] for p in tuned]
        low, high = min(batches), max(batches)
        lr, inside = loglog_interpolate(batches, [p["lr"] for p in tuned], global_batch_size)
        how = "log-log interpolation between measured batches"
        warnings = []
        if not inside:
            edge = low if global_batch_size < low else high
            if max(global_batch_size / edge, edge / global_batch_size) > EXTRAPOLATE_UP_TO:
                # Far past the data, a slope set by the last two points (a tie, say) is no evidence: the rule is.
                rule = "sqrt" if self._family() in ("adam", "adamw") else "linear"
                best = next(p["lr"] for p in tuned if p["global_batch_size"] == edge)
                lr = best * scaling.lr_multiplier(global_batch_size / edge, rule)
                how = (f"extrapolated: more than {EXTRAPOLATE_UP_TO:g}× outside the measured batches {low}–{high}, "
                       f"the {rule} rule from the best lr {best:.4g} at global batch {edge}")
            else:
                how = f"extrapolated from the end segment of the measured batches {low}–{high}"
            warnings.append(f"global batch {global_batch_size} lies outside the study's measured range "
                            f"{low}–{high}: the lr and B_crit are extrapolated")
        train_size = self.study.get("train_size")
        if train_size and global_batch_size > train_size:
            warnings.append(f"global batch {global_batch_size} is larger than the study's {train_size} training "
                            "samples: no run of the study could take a step this large, so its numbers say nothing "
                            "about it")
        workload = literal(self.study.get("workload", "?"))
        reason = (f"measured by ddplab study ({workload}): best lr on the tuned curve at "
                  f"global batch {global_batch_size} ({how}), in place of a rule; {_b_crit_words(self.study)}")
        return planner.MeasuredLr(lr=lr, reason=reason, warnings=tuple(warnings))

    def _family(self) -> str:
        optimizer = self.study.get("optimizer")
        return optimizer.get("family", "sgd") if isinstance(optimizer, dict) else "sgd"


EXTRAPOLATE_UP_TO = 2.0
"""How far past the measured batches the tuned curve's end segment is followed; beyond, the optimizer's rule."""


def _b_crit(study: dict) -> float | None:
    """The tuned fit's B_crit where it lies among the measured batches; None where the fit places it outside."""
    fit = study["fit"]["tuned"]
    return None if fit.get("bound") else float(fit["b_crit"])


def _b_crit_words(study: dict) -> str:
    b_crit = _b_crit(study)
    if b_crit is None:
        side, edge = next(iter(study["fit"]["tuned"]["bound"].items()))
        return f"B_crit {'<' if side == 'below' else '>'} {edge}, {side} the measured batches"
    return f"B_crit {b_crit:.4g} fitted to steps-to-target"


def _bound(study: dict) -> tuple[str, ...]:
    bound = study["fit"]["tuned"].get("bound")
    if not bound:
        return ()
    side, edge = next(iter(bound.items()))
    return (f"the study's B_crit lies {side} its measured batches (B_crit {'<' if side == 'below' else '>'} "
            f"{edge}): no critical batch is planned with",)


def _check_optimizer(reference: planner.Reference, study: dict) -> None:
    # A study without an optimizer field predates AdamW support: it trained SGD with momentum.
    # Adam and AdamW scale alike (their update is the same but for where weight decay enters).
    kind = {"sgd": "sgd", "adam": "adam", "adamw": "adam"}
    measured = (study.get("optimizer") or {}).get("family", "sgd")
    if kind.get(measured, measured) != kind[reference.optimizer]:
        name = (study.get("optimizer") or {}).get("name", measured.upper())
        raise UsageError(f"the study measured the best lr of {name}, and {{reference.optimizer}} "
                         f"{reference.optimizer} scales by other rules (square-root for Adam, Malladi et al. "
                         "2022; linear for SGD): study that optimizer, or plan by its rule without {from_study}")


def _with_noise_scale(reference: planner.Reference, loaded: dict) -> planner.Reference:
    """``reference`` with the B_simple the study measured (its JSON's ``b_simple.value``) as its noise scale."""
    if reference.noise_scale is not None:
        raise UsageError("{reference.noise_scale} and {from_study} both give the noise scale: drop one")
    value = (loaded.get("b_simple") or {}).get("value") if isinstance(loaded, dict) else None
    if not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise UsageError("{from_study} holds no positive B_simple (b_simple.value) for {target.rule} surge: pass "
                         "{reference.noise_scale}")
    return dataclasses.replace(reference, noise_scale=float(value))


def read_study(study: str | dict) -> dict:
    """A study's JSON (a path, or the loaded dict as it is)."""
    if isinstance(study, str):
        try:
            with open(study) as fh:
                study = json.load(fh)
        except (OSError, json.JSONDecodeError) as exc:
            raise UsageError(f"{{from_study}} {literal(repr(study))} is not a readable study JSON "
                             f"({exc.__class__.__name__})") from None
    if not isinstance(study, dict):
        raise UsageError("{from_study} is not a study JSON (no object): give a ddplab study's study.json")
    return study


def load_study(study: str | dict) -> dict:
    """A study's JSON, checked to hold what planning needs."""
    study = read_study(study)
    fit = (study.get("fit") or {}).get("tuned") if isinstance(study, dict) else None
    if not isinstance(study, dict) or not study.get("tuned_lr") or not fit or fit.get("b_crit") is None:
        raise UsageError("{from_study} needs a study with the 'tuned' rule, its best lrs and a fitted B_crit")
    return study


def loglog_interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> tuple[float, bool]:
    """y at x on the piecewise log-log line through (xs, ys); extrapolates the end segment; True when inside."""
    pairs = sorted(zip(xs, ys))
    if len(pairs) == 1:
        return pairs[0][1], x == pairs[0][0]
    inside = pairs[0][0] <= x <= pairs[-1][0]
    for i in range(1, len(pairs)):
        if x <= pairs[i][0] or i == len(pairs) - 1:
            (x0, y0), (x1, y1) = pairs[i - 1], pairs[i]
            slope = math.log(y1 / y0) / math.log(x1 / x0)
            return y0 * (x / x0) ** slope, inside
    raise AssertionError("unreachable")
