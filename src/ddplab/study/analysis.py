"""From runs to the study's answer: the runs table, the tuned curve, one fit per rule, and B_simple.

Pure Python over the engine's results (no torch): the fit is in :mod:`ddplab.study.fit`, the
noise-scale estimators in :mod:`ddplab.noise.estimators`.
"""

from __future__ import annotations

import dataclasses
import math

from ddplab.errors import UsageError
from ddplab.noise import estimators
from ddplab.study import fit, rules
from ddplab.study.config import StudyConfig
from ddplab.study.rules.base import BatchRuns, row
from ddplab.study.runs import RunResult, steps


@dataclasses.dataclass(frozen=True, kw_only=True)
class StudyAnalysis:
    runs: list[dict]
    """One row per (rule, batch, lr, seed), a run serving several rules listed once per rule."""
    tuned_lr: list[dict]
    """Per global batch: the best lr of the tuned sweep, its median steps, and the sweep."""
    fit: dict[str, dict]
    """Per rule: S_min, B_crit with its seed-bootstrap interval, E_min, the medians fitted and the regimes."""
    b_simple: dict | None
    """B_simple along the best tuned runs, with its 95% interval and B_crit / B_simple."""
    warnings: list[str]
    unreached: list[dict]
    """Per (rule, global batch) whose median run never reached the target: the best metric any of its runs got."""
    steps_by_rule: dict[str, dict[int, list[float]]]
    sections: dict = dataclasses.field(default_factory=dict)
    """The rules' sections of their own in the JSON (AdaScale's per batch, the ramp's against the tuned runs, …)."""

    @property
    def reached(self) -> bool:
        """Some run reached the target."""
        return any(r["steps_to_target"] is not None for r in self.runs)


def analyze(config: StudyConfig, results: dict[int, list[RunResult]]) -> StudyAnalysis:
    """The study's answer from its runs; UsageError when every lr of a batch size diverged."""
    _check_divergence(config, results)
    batches = {b: rules.view(config, b, results[b]) for b in sorted(results)}
    asked = rules.of(config)
    runs, tuned = [], []
    steps_by_rule: dict[str, dict[int, list[float]]] = {rule.name: {} for rule in asked if rule.fitted}
    sweep = rules.sweeping(config)
    for b, view in batches.items():
        if view.best is not None:
            tuned.append({"global_batch_size": b, "lr": view.best[0], "median_steps": view.best[1],
                          "sweep": sorted(lr for lr, names in view.lrs.items() if sweep.name in names)})
        runs += _grid_rows(view, sweep)
        for rule in asked:
            runs += rule.rows(view)
            seeds = rule.seeds_at(view) if rule.fitted else None
            if seeds is not None:
                steps_by_rule[rule.name][b] = [steps(run) for run in seeds]
    fits, warnings = _fits(steps_by_rule)
    warnings += _edge_warnings(tuned)
    for rule in asked:
        warnings += rule.warnings(config, batches)
    best_runs = [batches[p["global_batch_size"]].fixed[(p["lr"], s)] for p in tuned for s in range(config.seeds)]
    warnings += _collapsed_warnings(best_runs) + _monotonicity_warnings(steps_by_rule.get(sweep.name, {})
                                                                         if sweep else {})
    # A seed that never arrived measures a run stuck somewhere else: B_simple is taken along the runs that reached.
    best_runs = [r for r in best_runs if r.steps_to_target is not None]
    sections = {key: value for rule in rules.REGISTRY.values() for key, value in
                rule.report(config, batches, tuned).items()}
    return StudyAnalysis(runs=runs, tuned_lr=tuned, fit=fits,
                         b_simple=_b_simple(best_runs, fits.get(sweep.name) if sweep else None),
                         warnings=warnings, unreached=_unreached(config, batches), steps_by_rule=steps_by_rule,
                         sections=sections)


def _grid_rows(view: BatchRuns, sweep: rules.Rule | None) -> list[dict]:
    """The shared grid's runs, lr by lr, once for every rule each lr serves; the sweep's best starred."""
    out = []
    for lr, names in view.lrs.items():
        for name in names:
            best = sweep is not None and name == sweep.name and view.best is not None and lr == view.best[0]
            out += [row(name, view.global_batch_size, run, best=best) for run in view.seeds_at(lr)]
    return out


def _check_divergence(config: StudyConfig, results: dict[int, list[RunResult]]) -> None:
    sweeping = rules.sweeping(config)
    for b, runs in sorted(results.items()):
        fixed = [r for r in runs if r.fixed]
        lrs = rules.sweep_lrs(config, b, runs)
        sweep = [r for r in fixed if sweeping and sweeping.name in lrs.get(r.lr, [])] or fixed
        if sweep and all(r.diverged for r in sweep):
            lrs = [r.lr for r in sweep]
            raise UsageError(f"every lr {'of the tuned sweep ' if sweeping else ''}diverged at global "
                             f"batch {b} ({min(lrs):g} to {max(lrs):g}): lower {{reference_lr}} (runs are cached)")


def _fits(steps_by_rule: dict) -> tuple[dict, list[str]]:
    fits, warnings = {}, []
    for rule, by_batch in steps_by_rule.items():
        reached = {b: s for b, s in by_batch.items() if math.isfinite(fit.median(s))}
        if len(reached) < 2:
            warnings.append(f"rule {rule}: the median run reached the target at fewer than two batch sizes; no fit")
            continue
        fitted = fit.fit_seeds(reached)
        fits[rule] = {**fitted, "median_steps": {str(b): v for b, v in fitted["median_steps"].items()},
                      "seed_range": {str(b): v for b, v in fitted["seed_range"].items()},
                      "band": {str(b): v for b, v in fitted["band"].items()},
                      "batches_fitted": sorted(reached)}
        if not math.isfinite(fitted["b_crit"]):
            warnings.append(f"rule {rule}: steps fall as 1/B over the whole measured range; B_crit lies above it")
            continue
        if fitted["b_crit"] == 0:
            # A flat curve has no bend to place: B_crit and E_min = S_min·B_crit are not measured, not zero.
            fits[rule]["undefined"] = "steps do not fall as the batch grows"
            warnings.append(f"rule {rule}: its median steps do not fall as the batch grows over the measured range, so "
                            "the fit S_min(1 + B_crit/B) is flat: B_crit and E_min are undefined (every batch here is "
                            "past the critical batch, or the rule does not scale its lr with the batch)")
            continue
        warnings += _fit_warnings(rule, fitted)
    return fits, warnings


MISSED_BY = 1.5
"""A fit whose curve is off a fitted median by more than this factor is said to miss its points."""


def _fit_warnings(rule: str, fitted: dict) -> list[str]:
    """A fit that misses its points, and a B_crit on the edge of its own interval."""
    out = []
    s_min, b_crit = fitted["s_min"], fitted["b_crit"]
    misses = {b: s_min * (1 + b_crit / b) / median for b, median in fitted["median_steps"].items() if median > 0}
    worst = max(misses, key=lambda b: max(misses[b], 1 / misses[b]), default=None)
    if worst is not None and max(misses[worst], 1 / misses[worst]) > MISSED_BY:
        out.append(f"rule {rule}: the fit S_min(1 + B_crit/B) misses the median at global batch {worst} by "
                   f"{max(misses[worst], 1 / misses[worst]):.2g}×: the curve's shape does not describe these runs; "
                   "read B_crit as rough")
    low, high = fitted["b_crit_ci95"]
    # A point interval (every resample agreed) says so itself; an estimate on one end of a real one does not.
    point = math.isclose(low, high, rel_tol=1e-6)
    if math.isfinite(low) and math.isfinite(high) and not point and b_crit in (low, high):
        out.append(f"rule {rule}: B_crit {b_crit:.4g} sits on the edge of its 95% interval [{low:.4g}, {high:.4g}]: "
                   "resampling the seeds rarely moves it past its neighbours on the batch grid, so the interval "
                   "understates the uncertainty; a finer grid of batch sizes around it would tell")
    return out


def _collapsed_warnings(best_runs: list[RunResult]) -> list[str]:
    """Seeds of a batch's best lr that never arrived while its median did: they diverged or got stuck."""
    out = []
    for run in best_runs:
        if run.steps_to_target is None:
            how = "diverged" if run.diverged else "stalled (stopped improving)" if run.stalled else "ran out of steps"
            out.append(f"at global batch {run.global_batch_size}, seed {run.seed} of the best lr {run.lr:g} {how} "
                       "while its median seed arrived: left out of B_simple; more seeds would firm up the median")
    return out


def _monotonicity_warnings(tuned_steps: dict[int, list[float]]) -> list[str]:
    """A larger batch whose best median steps exceed a smaller one's beyond the seeds' spread: the tuned curve
    must not rise (a larger batch can always take the smaller's steps), so the sweep or the seeds are too thin."""
    out, batches = [], sorted(tuned_steps)
    for small, large in zip(batches, batches[1:]):
        low_small, _, high_small = fit.spread(tuned_steps[small])
        low_large, _, _ = fit.spread(tuned_steps[large])
        if math.isfinite(high_small) and low_large > high_small:
            out.append(f"the tuned curve rises from global batch {small} to {large} ({fit.median(tuned_steps[small]):g}"
                       f" to {fit.median(tuned_steps[large]):g} median steps, beyond the seeds' spread): the sweep or "
                       "the seeds are too thin there; add seeds or narrow --sweep-factor")
    return out


def _edge_warnings(tuned: list[dict]) -> list[str]:
    edge = [p["global_batch_size"] for p in tuned if p["lr"] in (p["sweep"][0], p["sweep"][-1]) and len(p["sweep"]) > 1]
    if not edge:
        return []
    return [(f"the best tuned lr sits at the edge of its sweep at global batch {', '.join(map(str, edge))}, "
             "which extends past its edge while --max-runs allows: raise --max-runs or widen --sweep-margin")]


def _b_simple(best_runs: list[RunResult], tuned_fit: dict | None) -> dict | None:
    """B_simple pooled along the best runs, and per batch size in three stretches of each run's way to the
    target (B_simple grows as the loss falls: a pooled value mixes them, weighted to the slow small batches)."""
    pooled = _summary(best_runs)
    if pooled is None:
        return None
    # No ratio where B_simple's interval cannot tell it from zero, or reaches infinity (|G|² indistinguishable from
    # 0): it would only measure the estimator's noise.
    low, high = pooled["ci95"]
    bounded = low is not None and high is not None and 0 < low and math.isfinite(high)
    ratio = fit.ratio(tuned_fit["b_crit"], pooled["value"]) if tuned_fit and pooled["value"] > 0 and bounded else None
    by_batch = []
    for b in sorted({r.global_batch_size for r in best_runs}):
        runs = [r for r in best_runs if r.global_batch_size == b]
        stages = [_summary(runs, stage) for stage in range(3)]
        by_batch.append({"global_batch_size": b, **(_summary(runs) or {"value": None}),
                         "by_progress": [s["value"] if s else None for s in stages]})
    return {**pooled, "b_crit_over_b_simple": ratio, "by_batch": by_batch, "measured": _measured(pooled["steps"])}


def _measured(steps: list[int] | None) -> str:
    """Where B_simple was measured, for a reader comparing it with ddplab noise."""
    where = f" (training steps {steps[0]} to {steps[1]})" if steps else ""
    return (f"at the evaluations of the best tuned runs, from their first steps to the target{where}: early "
            "training (B_simple moves as the loss falls; by_progress shows how), each global batch split into its "
            "DDP ranks' shares as ddplab noise splits it. At the same weights and batches the two give the same "
            "numbers; ddplab noise, from the spec's initial weights at its own lr over --steps, measures another "
            "stretch of training")


def _summary(runs: list[RunResult], stage: int | None = None) -> dict | None:
    """B_simple of the runs' measurements (of the stage-th third of each run's, when given), with its interval and
    the training steps it was measured between."""
    g2s, traces, steps_measured = [], [], []
    for run in runs:
        n = len(run.noise_g2)
        part = slice(None) if stage is None else slice(stage * n // 3, (stage + 1) * n // 3)
        g2s += run.noise_g2[part]
        traces += run.noise_trace[part]
        # One measurement per evaluation: the history's steps say when each was taken.
        if len(run.history) == n:
            steps_measured += [h[0] for h in run.history[part]]
    if len(g2s) < 2:
        return None
    summary = estimators.summarize(g2s, traces)
    interval = list(summary.b_simple_ci95) if summary.b_simple_ci95 is not None else [None, None]
    span = [min(steps_measured), max(steps_measured)] if steps_measured else None
    return {"value": summary.b_simple, "ci95": interval, "measurements": summary.steps, "steps": span}


def _unreached(config: StudyConfig, batches: dict[int, BatchRuns]) -> list[dict]:
    """Per (rule, batch) whose median run missed the target: how close its runs got."""
    out = []
    for b, view in batches.items():
        runs = list(view.fixed.values()) + [run for own in view.own.values() for run in own.values()]
        for rule in rules.of(config):
            served = [run for run in runs if rule.serves(run, view.lrs)]
            if served and math.isinf(_median_steps(served)):
                out.append({"rule": rule.name, "global_batch_size": b, "best_metric": _best_metric(config, served)})
    return out


def _median_steps(runs: list[RunResult]) -> float:
    """The fewest median steps over the runs' lrs (inf when no lr's median run reached the target)."""
    by_lr: dict[float, list[float]] = {}
    for run in runs:
        by_lr.setdefault(run.lr, []).append(steps(run))
    best = fit.best_lr(by_lr)
    return best[1] if best else math.inf


def _best_metric(config: StudyConfig, runs: list[RunResult]) -> float | None:
    metrics = [h[2] for run in runs for h in run.history if h[2] is not None and math.isfinite(h[2])]
    if not metrics:
        return None
    return max(metrics) if config.target.kind == "accuracy" else min(metrics)
