"""From runs to the study's answer: the runs table, the tuned curve, one fit per rule, and B_simple.

Pure Python over the engine's results (no torch): the fit is in :mod:`ddplab.study.fit`, the
noise-scale estimators in :mod:`ddplab.noise.estimators`.
"""

from __future__ import annotations

import dataclasses
import math

from ddplab.errors import UsageError
from ddplab.noise import estimators
from ddplab.study import fit
from ddplab.study.config import Rule, StudyConfig, round_lr
from ddplab.study.engine import RunResult


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
    steps_by_rule: dict[Rule, dict[int, list[float]]]
    adascale: list[dict] = dataclasses.field(default_factory=list)
    """Per global batch AdaScale ran at: its median steps beside the best-tuned fixed lr's, and its mean gain."""
    ramp: dict | None = None
    """The ramp runs against the best-tuned fixed lr at their starting batch: steps and samples to target."""

    @property
    def reached(self) -> bool:
        """Some run reached the target."""
        return any(r["steps_to_target"] is not None for r in self.runs)


def analyze(config: StudyConfig, results: dict[int, list[RunResult]]) -> StudyAnalysis:
    """The study's answer from its runs; UsageError when every lr of a batch size diverged."""
    # AdaScale's runs share the reference lr with the constant rule's: they are told apart by their flag.
    by_key = {(b, r.lr, r.seed): r for b, rs in results.items() for r in rs if r.fixed}
    adaptive = {(b, r.seed): r for b, rs in results.items() for r in rs if r.adascale}
    scaled = {(b, r.seed): r for b, rs in results.items() for r in rs if r.adam_sqrt}
    ramps = {r.seed: r for rs in results.values() for r in rs if r.ramp}
    _check_divergence(config, results)
    # The ramp has no one batch size to fit at: it is judged against the tuned runs at its start instead.
    runs, steps_by_rule, tuned = [], {rule: {} for rule in config.rules if rule != "ramp"}, []
    for b in sorted(results):
        lrs = sweep_lrs(config, b, results[b])
        best = tuned_best(config, b, lrs, by_key) if "tuned" in config.rules else None
        if best is not None:
            tuned.append({"global_batch_size": b, "lr": best[0], "median_steps": best[1],
                          "sweep": sorted(lr for lr, rules in lrs.items() if "tuned" in rules)})
        runs += _rows(config, b, lrs, by_key, best) + _adascale_rows(config, b, adaptive)
        runs += [_row("adam-sqrt", b, scaled[(b, s)]) for s in range(config.seeds) if (b, s) in scaled]
        runs += [_ramp_row(ramps[s]) for s in sorted(ramps) if ramps[s].global_batch_size == b]
        for rule in config.rules:
            if rule == "ramp":
                continue
            if rule in ("adascale", "adam-sqrt"):
                own = adaptive if rule == "adascale" else scaled
                if (b, 0) in own:
                    steps_by_rule[rule][b] = [_steps(own[(b, s)]) for s in range(config.seeds)]
                continue
            if rule == "tuned" and best is None:
                continue
            lr = best[0] if rule == "tuned" else round_lr(config.rule_lr(rule, b))
            steps_by_rule[rule][b] = [_steps(by_key[(b, lr, s)]) for s in range(config.seeds)]
    fits, warnings = _fits(steps_by_rule)
    warnings += _edge_warnings(tuned) + _adam_sqrt_warnings(config, scaled)
    best_runs = [by_key[(p["global_batch_size"], p["lr"], s)] for p in tuned for s in range(config.seeds)]
    warnings += _collapsed_warnings(best_runs) + _monotonicity_warnings(steps_by_rule.get("tuned", {}))
    # A seed that never arrived measures a run stuck somewhere else: B_simple is taken along the runs that reached.
    best_runs = [r for r in best_runs if r.steps_to_target is not None]
    return StudyAnalysis(runs=runs, tuned_lr=tuned, fit=fits, b_simple=_b_simple(best_runs, fits.get("tuned")),
                         warnings=warnings, unreached=_unreached(config, results), steps_by_rule=steps_by_rule,
                         adascale=_adascale_summary(config, adaptive, tuned), ramp=_ramp_summary(ramps, tuned))


def _row(rule: str, b: int, run: RunResult, *, best: bool = False, **extra) -> dict:
    """One run as the runs table lists it (a run serving several rules is listed once per rule)."""
    return {"rule": rule, "global_batch_size": b, "lr": run.lr, "seed": run.seed,
            "steps_to_target": run.steps_to_target, "samples_to_target": _samples(run, b), "diverged": run.diverged,
            "stalled": run.stalled, "pruned": run.pruned, "extension": run.extension, "best": best, **extra}


def _ramp_row(run: RunResult) -> dict:
    return _row("ramp", run.global_batch_size, run, trajectory=run.trajectory)


def _ratio(value: float, reference: float | None) -> float | None:
    """value / reference where both are finite numbers, else None (JSON null)."""
    ok = reference and math.isfinite(value) and math.isfinite(reference)
    return value / reference if ok else None


def _ramp_summary(ramps: dict[int, RunResult], tuned: list[dict]) -> dict | None:
    """Median steps and samples of the ramp runs over those of the best-tuned fixed lr at their starting batch."""
    if not ramps:
        return None
    start = next(iter(ramps.values())).global_batch_size
    runs = [ramps[s] for s in sorted(ramps)]
    steps = fit.median([_steps(r) for r in runs])
    samples = fit.median([float(r.samples_to_target) if r.samples_to_target is not None else math.inf
                          for r in runs])
    fixed = next((p["median_steps"] for p in tuned if p["global_batch_size"] == start), None)
    fixed_samples = fixed * start if fixed is not None else None
    return {"start_global_batch_size": start, "lr": runs[0].lr, "median_steps": steps, "median_samples": samples,
            "tuned_median_steps": fixed, "tuned_median_samples": fixed_samples,
            "steps_over_tuned": _ratio(steps, fixed), "samples_over_tuned": _ratio(samples, fixed_samples),
            "final_global_batch_sizes": [r.trajectory[-1][1] if r.trajectory else start for r in runs]}


def _adascale_rows(config: StudyConfig, b: int, adaptive: dict) -> list[dict]:
    rows = []
    for seed in range(config.seeds):
        run = adaptive.get((b, seed))
        if run is not None:
            rows.append(_row("adascale", b, run, gains=run.gains))
    return rows


def _adascale_summary(config: StudyConfig, adaptive: dict, tuned: list[dict]) -> list[dict]:
    """AdaScale against the best-tuned fixed lr at the same batch: the issue's measure of 'no tuning needed'."""
    best = {p["global_batch_size"]: p["median_steps"] for p in tuned}
    out = []
    for b in sorted({b for b, _ in adaptive}):
        seeds = [adaptive[(b, s)] for s in range(config.seeds)]
        median = fit.median([_steps(r) for r in seeds])
        gains = [g[1] for r in seeds for g in r.gains]
        tuned_steps = best.get(b)
        out.append({"global_batch_size": b, "scale": b / config.reference_global_batch_size, "median_steps": median,
                    "tuned_median_steps": tuned_steps, "steps_over_tuned": _ratio(median, tuned_steps),
                    "mean_gain": sum(gains) / len(gains) if gains else None})
    return out


def _rows(config: StudyConfig, b: int, lrs: dict, by_key: dict, best) -> list[dict]:
    rows = []
    for lr, rules in lrs.items():
        for rule in rules:
            for seed in range(config.seeds):
                rows.append(_row(rule, b, by_key[(b, lr, seed)],
                                 best=rule == "tuned" and best is not None and lr == best[0]))
    return rows


def _check_divergence(config: StudyConfig, results: dict[int, list[RunResult]]) -> None:
    for b, runs in sorted(results.items()):
        fixed = [r for r in runs if r.fixed]
        sweep = [r for r in fixed if "tuned" in sweep_lrs(config, b, runs).get(r.lr, [])] or fixed
        if sweep and all(r.diverged for r in sweep):
            lrs = [r.lr for r in sweep]
            raise UsageError(f"every lr {'of the tuned sweep ' if 'tuned' in config.rules else ''}diverged at global "
                             f"batch {b} ({min(lrs):g} to {max(lrs):g}): lower {{reference_lr}} (runs are cached)")


def _samples(run: RunResult, global_batch: int) -> int | None:
    """Samples to the target: what the run counted (a ramp's batch changes), else steps × its fixed batch."""
    if run.samples_to_target is not None or run.steps_to_target is None:
        return run.samples_to_target
    return run.steps_to_target * global_batch


def _steps(run: RunResult) -> float:
    return float(run.steps_to_target) if run.steps_to_target is not None else math.inf


def sweep_lrs(config: StudyConfig, b: int, runs: list[RunResult]) -> dict[float, list[Rule]]:
    """Every fixed lr trained at global batch ``b`` and the rules it serves: the grid's, and the tuned sweep's
    extensions past its edge."""
    lrs = {lr: list(rules) for lr, rules in config.lrs(b).items()}
    for run in runs:
        if run.extension:
            lrs.setdefault(run.lr, ["tuned"])
    return lrs


def tuned_best(config: StudyConfig, b: int, lrs: dict, by_key: dict) -> tuple[float, float] | None:
    """(lr, median steps) of the tuned sweep's best lr at global batch ``b``; None when no lr's median arrived."""
    sweep = {lr: [_steps(by_key[(b, lr, s)]) for s in range(config.seeds)]
             for lr, rules in lrs.items() if "tuned" in rules}
    return fit.best_lr(sweep)


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


def _adam_sqrt_warnings(config: StudyConfig, scaled: dict) -> list[str]:
    clamped = {b: config.adam_sqrt_optimizer(b)[1] for b, _ in scaled}
    at = sorted(b for b, names in clamped.items() if names)
    if not at:
        return []
    return [f"the adam-sqrt rule's 1 − k(1 − β) falls below 0 at global batch {', '.join(map(str, at))}: clamped "
            "to 0 (as ddplab plan does); the rule was derived for batches that grow less than 1/(1 − β₁)"]


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
    # B_simple is undefined (inf) where |G|² came out at or below 0: no ratio then, rather than 0.
    ratio = _ratio(tuned_fit["b_crit"], pooled["value"]) if tuned_fit and pooled["value"] > 0 else None
    by_batch = []
    for b in sorted({r.global_batch_size for r in best_runs}):
        runs = [r for r in best_runs if r.global_batch_size == b]
        stages = [_summary(runs, stage) for stage in range(3)]
        by_batch.append({"global_batch_size": b, **(_summary(runs) or {"value": None}),
                         "by_progress": [s["value"] if s else None for s in stages]})
    return {**pooled, "b_crit_over_b_simple": ratio, "by_batch": by_batch}


def _summary(runs: list[RunResult], stage: int | None = None) -> dict | None:
    """B_simple of the runs' measurements (of the stage-th third of each run's, when given), with its interval."""
    g2s, traces = [], []
    for run in runs:
        n = len(run.noise_g2)
        part = slice(None) if stage is None else slice(stage * n // 3, (stage + 1) * n // 3)
        g2s += run.noise_g2[part]
        traces += run.noise_trace[part]
    if len(g2s) < 2:
        return None
    summary = estimators.summarize(g2s, traces)
    interval = list(summary.b_simple_ci95) if summary.b_simple_ci95 is not None else [None, None]
    return {"value": summary.b_simple, "ci95": interval, "measurements": summary.steps}


def _unreached(config: StudyConfig, results: dict[int, list[RunResult]]) -> list[dict]:
    """Per (rule, batch) whose median run missed the target: how close its runs got."""
    out = []
    for b, runs in sorted(results.items()):
        lrs = sweep_lrs(config, b, runs)
        for rule in config.rules:
            own = {"adascale": "adascale", "ramp": "ramp", "adam-sqrt": "adam_sqrt"}
            served = [r for r in runs if all(getattr(r, flag) == (rule == name) for name, flag in own.items())
                      and (rule in own or rule in lrs.get(r.lr, []))]
            if served and math.isinf(_median_steps(served)):
                out.append({"rule": rule, "global_batch_size": b, "best_metric": _best_metric(config, served)})
    return out


def _median_steps(runs: list[RunResult]) -> float:
    """The fewest median steps over the runs' lrs (inf when no lr's median run reached the target)."""
    by_lr: dict[float, list[float]] = {}
    for run in runs:
        by_lr.setdefault(run.lr, []).append(_steps(run))
    best = fit.best_lr(by_lr)
    return best[1] if best else math.inf


def _best_metric(config: StudyConfig, runs: list[RunResult]) -> float | None:
    metrics = [h[2] for run in runs for h in run.history if h[2] is not None and math.isfinite(h[2])]
    if not metrics:
        return None
    return max(metrics) if config.target.kind == "accuracy" else min(metrics)
