"""From runs to the study's answer: the runs table, the tuned curve, one fit per rule, and B_simple.

Pure Python over the engine's results (no torch): the fit is in :mod:`ddplab.study.fit`, the
noise-scale estimators in :mod:`ddplab.noise.estimators`.
"""

from __future__ import annotations

import dataclasses
import math

from ddplab.errors import UsageError
from ddplab.study import fit
from ddplab.study.config import StudyConfig
from ddplab.study.grid import rounding
from ddplab.study.rules import base, registry, sweep
from ddplab.study.rules.base import BatchRuns, row
from ddplab.study.runs import RunResult, b_simple_summary, steps


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
    scorecard: dict[str, dict] = dataclasses.field(default_factory=dict)
    """Per rule, medians over the batches: how far its lr is from the best tuned lr (|log₂|) and its steps over the
    best tuned runs', with the seeds' range of that ratio and where it beat the tuned runs beyond it."""
    scorecard_note: str | None = None
    """Why the scorecard ranks no rule (one seed, or every rule's seed range overlapping every other's); None where
    some two rules are told apart."""
    lr_peak: dict | None = None
    """Adam-family studies: the batch where the best tuned lr peaks inside the measured range (None where it does
    not), and B_simple at the reference batch."""
    rules_lr: dict | None = None
    """The lr the rules scaled from and its source (:func:`ddplab.study.rules.rules_lr`)."""

    @property
    def reached(self) -> bool:
        """Some run reached the target."""
        return any(r["steps_to_target"] is not None for r in self.runs)


def analyze(config: StudyConfig, results: dict[int, list[RunResult]]) -> StudyAnalysis:
    """The study's answer from its runs; UsageError when every lr of a batch size diverged."""
    _check_divergence(config, results)
    scaled_from = sweep.rules_lr(config, results)
    config = sweep.anchored(config, results)
    batches = {b: sweep.view(config, b, results[b]) for b in sorted(results)}
    asked = registry.of(config)
    runs, tuned = [], []
    steps_by_rule: dict[str, dict[int, list[float]]] = {rule.name: {} for rule in asked if rule.fitted}
    runs_by_rule: dict[str, dict[int, list[RunResult]]] = {name: {} for name in steps_by_rule}
    sweep_rule = registry.sweeping(config)
    for b, view in batches.items():
        if view.best is not None:
            best = view.seeds_at(view.best.lr, view.best.variant)
            tuned.append({"global_batch_size": b, "lr": view.best.lr, "median_steps": view.best.median_steps,
                          "variant": view.best.variant, "optimizer": best[0].optimizer,
                          "sweep": sorted(lr for lr, names in view.lrs.items() if sweep_rule.name in names),
                          "variants": list(view.variants)})
        runs += _grid_rows(view, sweep_rule)
        for rule in asked:
            runs += rule.rows(view)
            seeds = rule.seeds_at(view) if rule.fitted else None
            if seeds is not None:
                steps_by_rule[rule.name][b] = [steps(run) for run in seeds]
                runs_by_rule[rule.name][b] = seeds
    fits, warnings = _fits(steps_by_rule)
    warnings += _rounding_warnings(config, runs_by_rule, fits)
    warnings = _reference_added(config) + warnings + _edge_warnings(tuned)
    for rule in asked:
        warnings += rule.warnings(config, batches)
    best_runs = [run for p in tuned for run in batches[p["global_batch_size"]].seeds_at(p["lr"], p["variant"])]
    warnings += _rules_lr_warnings(config, scaled_from)
    ties = {b: tied for b, view in batches.items() if (tied := tied_best(config, view))}
    warnings += _tie_warnings(config, batches, ties)
    warnings += _collapsed_warnings(best_runs) + _monotonicity_warnings(steps_by_rule.get(sweep_rule.name, {})
                                                                         if sweep_rule else {})
    # A seed that never arrived measures a run stuck somewhere else: B_simple is taken along the runs that reached.
    best_runs = [r for r in best_runs if r.steps_to_target is not None]
    sections = _sections([rule.report(config, batches, tuned) for rule in registry.known().values()])
    if sections.get("adaptive"):
        front = fits.get(sweep_rule.name) if sweep_rule else None
        sections["adaptive"] = against_the_front(sections["adaptive"], tuned, front)
    card = scorecard(config, batches)
    warnings += _beats_tuned_warnings(card)
    warnings += _early_target_warnings(config, fits, steps_by_rule)
    b_simple = _b_simple(best_runs, fits.get(sweep_rule.name) if sweep_rule else None)
    return StudyAnalysis(runs=runs, tuned_lr=tuned, fit=fits, b_simple=b_simple,
                         warnings=warnings, unreached=_unreached(config, batches), steps_by_rule=steps_by_rule,
                         sections=sections, scorecard=card, scorecard_note=scorecard_note(config.seeds, card),
                         lr_peak=lr_peak(config, tuned, b_simple, ties),
                         rules_lr=scaled_from)


def _reference_added(config: StudyConfig) -> list[str]:
    """The reference batch the grid left out and the study trained, and the rules that made it."""
    if not config.reference_trained_for:
        return []
    why = "; ".join(f"the {name} rule needs it for {registry.get(name).measures_at_reference(config)}"
                    for name in config.reference_trained_for)
    return [f"global batch {config.reference_global_batch_size}, the reference, was not in --global-batch-sizes and "
            f"was trained too: {why}"]


def _rules_lr_warnings(config: StudyConfig, scaled_from: dict) -> list[str]:
    """Where the rules could not scale from the tuned best at the reference batch although they were to."""
    if scaled_from["source"] != "reference_lr" or registry.sweeping(config) is None:
        return []
    reference = config.reference_global_batch_size
    if reference not in config.global_batch_sizes:
        why = f"the reference batch {reference} is not among the global batch sizes"
    else:
        why = f"no lr of the tuned sweep at the reference batch {reference} had its median run reach the target"
    return [f"the rules scale from the reference lr {config.reference_lr:g}, not the best tuned lr at the reference "
            f"batch: {why}"]


def _sections(reports: list[dict]) -> dict:
    """The rules' sections, a key several rules report (``adaptive``) merged into one dict."""
    out: dict = {}
    for report in reports:
        for key, value in report.items():
            if isinstance(out.get(key), dict) and isinstance(value, dict):
                out[key] = {**out[key], **value}
            else:
                out[key] = value
    return out


def dominated_by(steps: float, samples: float, fixed: list[tuple[int, float]]) -> list[int]:
    """The fixed global batches that reach the target in both fewer steps and fewer samples than ``steps`` and
    ``samples``. ``fixed`` holds each batch's median steps (inf where its median run never arrived), its samples being
    steps × batch. Strictly fewer in both: a tie in either is no domination.

    >>> fixed = [(32, 135.0), (64, 95.0), (128, 85.0)]
    >>> dominated_by(105.0, 9200.0, fixed), dominated_by(80.0, 8160.0, fixed)
    ([64], [])
    >>> dominated_by(95.0, 7000.0, fixed + [(16, math.inf)]), dominated_by(math.inf, math.inf, fixed)
    ([], [32, 64, 128])
    """
    return sorted(b for b, fixed_steps in fixed
                  if math.isfinite(fixed_steps) and fixed_steps < steps and fixed_steps * b < samples)


def against_the_front(adaptive: dict[str, dict], tuned: list[dict], tuned_fit: dict | None) -> dict[str, dict]:
    """Each rule whose batch changes judged against the fixed-batch Pareto front of the same study: the tuned sweep's
    batches that reach the target in both fewer steps and fewer samples (``dominated_by``; empty: on or below the
    measured front), and the samples the tuned fit's front (S/S_min − 1)(E/E_min − 1) = 1 needs at the rule's median
    steps (``front_samples_at_steps``; None where it reaches no such steps or nothing was fitted)."""
    fixed = [(p["global_batch_size"], p["median_steps"]) for p in tuned]
    s_min, e_min = (tuned_fit["s_min"], tuned_fit["e_min"]) if tuned_fit and not tuned_fit.get("undefined") else \
        (math.nan, math.nan)
    return {name: {**entry, "dominated_by": dominated_by(entry["median_steps"], entry["median_samples"], fixed),
                   "front_samples_at_steps": fit.front_samples(entry["median_steps"], s_min, e_min)}
            for name, entry in adaptive.items()}


def _grid_rows(view: BatchRuns, sweep: base.Rule | None) -> list[dict]:
    """The shared grid's runs, lr by lr, once for every rule each lr serves (the sweep's with each of its variants);
    the sweep's best starred."""
    out = []
    for lr, names in view.lrs.items():
        for name in names:
            swept = sweep is not None and name == sweep.name
            for variant in ("", *view.variants) if swept else ("",):
                runs = [view.fixed.get((lr, seed, variant)) for seed in range(view.config.seeds)]
                if None in runs:
                    continue
                best = swept and view.best is not None and (lr, variant) == (view.best.lr, view.best.variant)
                out += [row(name, view.global_batch_size, run, best=best) for run in runs]
    return out


def _check_divergence(config: StudyConfig, results: dict[int, list[RunResult]]) -> None:
    sweeping = registry.sweeping(config)
    for b, runs in sorted(results.items()):
        fixed = [r for r in runs if r.fixed]
        lrs = sweep.sweep_lrs(config, b, runs)
        swept = [r for r in fixed if sweeping and sweeping.name in lrs.get(r.lr, [])] or fixed
        if swept and all(r.diverged for r in swept):
            lrs = [r.lr for r in swept]
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
        left_out = sorted(set(by_batch) - set(reached))
        if left_out:
            warnings.append(f"rule {rule}: fitted on global batches {_batches(reached)} only: the median run did not "
                            f"reach the target at {_batches(left_out)}, which the fit leaves out")
        if not math.isfinite(fitted["b_crit"]):
            fits[rule]["bound"] = {"above": max(reached)}
            warnings.append(f"rule {rule}: steps fall as 1/B over the whole measured range; B_crit lies above it")
            continue
        if fitted["b_crit"] == 0:
            # A flat curve has no bend to place: B_crit and E_min = S_min·B_crit are not measured, not zero.
            fits[rule]["undefined"] = "steps do not fall as the batch grows"
            warnings.append(f"rule {rule}: its median steps do not fall as the batch grows over the measured range, so "
                            "the fit S_min(1 + B_crit/B) is flat: B_crit and E_min are undefined (every batch here is "
                            "past the critical batch, or the rule does not scale its lr with the batch)")
            continue
        bound = _outside(fitted["b_crit"], sorted(reached))
        if bound is not None:
            # A bend the data do not hold: the fit's B_crit says only on which side of the measured batches it is.
            fits[rule]["bound"] = bound
            side = next(iter(bound))
            warnings.append(f"rule {rule}: B_crit is fitted at {fitted['b_crit']:.3g}, {side} the measured batches "
                            f"{_batches(reached)}: read it as {fit.bound_reading(bound)}, not as "
                            f"a value; measure {'smaller' if side == 'below' else 'larger'} batches to place it")
            continue
        if len(reached) == 2:
            warnings.append(f"rule {rule}: fitted on 2 global batches ({_batches(reached)}): two points fix S_min and "
                            "B_crit exactly, so nothing tests the curve's shape; read B_crit as rough, or measure "
                            "a third batch")
        warnings += _fit_warnings(rule, fitted)
    seeds = min((len(s) for by_batch in steps_by_rule.values() for s in by_batch.values()), default=0)
    if fits and seeds == 2:
        warnings.append(FEW_SEEDS)
    return fits, warnings


def _rounding_warnings(config: StudyConfig, runs_by_rule: dict[str, dict[int, list[RunResult]]],
                       fits: dict) -> list[str]:
    """Per rule, a fit that turning its edge runs over would move: said, and recorded in its fit as ``rounding``."""
    out = []
    for rule, by_batch in runs_by_rule.items():
        edges = [edge for seeds in by_batch.values() for edge in rounding.edge_runs(config, seeds)]
        turned = {}
        for way in rounding.TURNS:
            these = [edge for edge in edges if rounding.turn(edge) == way]
            if not these:
                continue
            flipped = _fits({rule: rounding.flipped_steps(by_batch, these)})[0].get(rule)
            if rounding.moved(fits.get(rule), flipped):
                turned[way] = flipped
        if not turned:
            continue
        if rule in fits:
            fits[rule]["rounding"] = {"edge_runs": [edge.to_json() for edge in edges],
                                      "turned": {way: rounding.reading(f) for way, f in turned.items()}}
        out.append(rounding.rounding_warning(rule, edges, fits.get(rule), turned))
    return out


def _outside(b_crit: float, batches: list[int]) -> dict[str, int] | None:
    """{"below": smallest} or {"above": largest} where the fitted B_crit lies outside the batches it was fitted on."""
    if b_crit < batches[0]:
        return {"below": batches[0]}
    if b_crit > batches[-1]:
        return {"above": batches[-1]}
    return None


def _batches(batches) -> str:
    return ", ".join(str(b) for b in sorted(batches))


FEW_SEEDS = ("B_crit's 95% intervals resample 2 seeds, so each batch's median can take at most 3 values: they "
             "understate the uncertainty (another engine's float32 rounding alone can move B_crit outside them); "
             "more seeds (--seeds 5 or more) give intervals worth reading")
"""Said once per study of 2 seeds: a bootstrap over so few draws is far narrower than the spread it stands for."""


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


def _early_target_warnings(config: StudyConfig, fits: dict, steps_by_rule: dict) -> list[str]:
    """A target reached too early for the evaluations to tell its steps apart, said only on its evidence: medians
    at the first evaluation, or every B_crit interval of zero width although there were seeds to resample."""
    evidence = []
    first = sorted({b for by_batch in steps_by_rule.values() for b, seeds in by_batch.items()
                    if fit.median(seeds) <= config.eval_every})
    if first:
        evidence.append(f"median runs reached it at the first evaluation (step {config.eval_every}) at global batch "
                        f"{', '.join(map(str, first))}")
    intervals = [fitted["b_crit_ci95"] for fitted in fits.values()
                 if "undefined" not in fitted and all(map(math.isfinite, fitted["b_crit_ci95"]))]
    seeds = min((len(s) for by_batch in steps_by_rule.values() for s in by_batch.values()), default=0)
    if seeds >= 2 and intervals and all(math.isclose(low, high, rel_tol=1e-6) for low, high in intervals):
        evidence.append("every B_crit 95% interval has zero width (the seeds' steps, counted at evaluations, agree at "
                        "every batch)")
    if not evidence:
        return []
    if fits and all(len(fitted["batches_fitted"]) == 2 for fitted in fits.values()):
        evidence.append("each curve has 2 points, which S_min(1 + B_crit/B) always passes through")
    harder = "a lower --target-loss" if config.target.kind == "loss" else "a higher --target-accuracy"
    often = f", or evaluate more often (--eval-every below {config.eval_every})" if config.eval_every > 1 else ""
    return [f"the target is reached too early to measure the steps to it: {'; '.join(evidence)}. Raise the target "
            f"({harder}){often}"]


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
    pooled = b_simple_summary(best_runs)
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
        stages = [b_simple_summary(runs, stage) for stage in range(3)]
        by_batch.append({"global_batch_size": b, **(b_simple_summary(runs) or {"value": None}),
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


def _unreached(config: StudyConfig, batches: dict[int, BatchRuns]) -> list[dict]:
    """Per (rule, batch) whose median run missed the target: how close its runs got, and how many arrived (a run
    that arrived reached the target, so the best metric can pass it while the median missed)."""
    out = []
    for b, view in batches.items():
        runs = list(view.fixed.values()) + [run for own in view.own.values() for run in own.values()]
        for rule in registry.of(config):
            served = [run for run in runs if rule.serves(run, view.lrs)]
            if served and math.isinf(_median_steps(served)):
                out.append({"rule": rule.name, "global_batch_size": b, "best_metric": _best_metric(config, served),
                            "arrived": sum(run.steps_to_target is not None for run in served), "runs": len(served)})
    return out


def _median_steps(runs: list[RunResult]) -> float:
    """The fewest median steps over the runs' settings, (lr, variant) (inf when no setting's median run reached the
    target)."""
    by_lr: dict[tuple[float, str], list[float]] = {}
    for run in runs:
        by_lr.setdefault((run.lr, run.variant), []).append(steps(run))
    best = fit.best_lr(by_lr)
    return best[1] if best else math.inf


def _best_metric(config: StudyConfig, runs: list[RunResult]) -> float | None:
    metrics = [h[2] for run in runs for h in run.history if h[2] is not None and math.isfinite(h[2])]
    if not metrics:
        return None
    return max(metrics) if config.target.kind == "accuracy" else min(metrics)


def scorecard(config: StudyConfig, batches: dict[int, BatchRuns]) -> dict[str, dict]:
    """Per rule, over the batches where the tuned sweep has a best: the median |log₂(lr / best lr)|, the median of
    its median steps over the best's (inf where its median run never arrived; None once that is the median), that
    ratio's seed range (medians of its fewest and most seeds' steps over the best's), and the batches where every
    seed of it beat every seed of the best (the sweep missed a better setting there)."""
    out = {}
    for rule in registry.of(config):
        gaps, ratios, lows, highs, beats = [], [], [], [], []
        for b, view in batches.items():
            if view.best is None:
                continue
            lr = rule.lr_at(view)
            if lr is not None and lr > 0:
                gaps.append(abs(math.log2(lr / view.best.lr)))
            runs = rule.seeds_at(view)
            if not runs:
                continue
            best = view.best.median_steps
            low, median, high = fit.spread([steps(r) for r in runs])
            ratios.append(median / best)
            lows.append(low / best)
            highs.append(high / best)
            tuned = fit.spread([steps(r) for r in view.seeds_at(view.best.lr, view.best.variant)])
            # Only a fixed lr at a fixed batch is a setting the sweep could have tried (not AdaScale's, nor the ramp's).
            comparable = not rule.sweeps and rule.fitted and rule.lr_scaling == "fixed"
            if comparable and high < tuned[0]:
                beats.append({"global_batch_size": b, "steps": [low, high], "tuned_steps": [tuned[0], tuned[2]],
                              "tuned_lr": view.best.lr, "tuned_variant": view.best.variant, "lr": lr})
        ratio = fit.median(ratios) if ratios else math.inf
        out[rule.name] = {"median_abs_log2_lr_gap": fit.median(gaps) if gaps else None,
                          "median_steps_ratio": ratio if math.isfinite(ratio) else None,
                          "steps_ratio_seed_range": [fit.median(lows), fit.median(highs)] if ratios else None,
                          "batches": len(ratios), "beats_tuned": beats}
    return out


def scorecard_note(seeds: int, card: dict[str, dict]) -> str | None:
    """Why the scorecard cannot rank the rules, or None where it can: some rule's seed range of steps ÷ tuned lies
    wholly above another's (a rule whose seeds never arrived reaches infinity). One seed measures no range.

    >>> card = {"a": {"steps_ratio_seed_range": [0.9, 1.1]}, "b": {"steps_ratio_seed_range": [1.0, 1.3]}}
    >>> scorecard_note(2, card) is not None
    True
    >>> card["b"]["steps_ratio_seed_range"] = [1.2, 1.3]
    >>> scorecard_note(2, card) is None
    True
    """
    ranges = [row["steps_ratio_seed_range"] for row in card.values() if row.get("steps_ratio_seed_range")]
    if not ranges:
        return None  # nothing scored: no table to hold back
    if seeds < 2:
        return ("one seed measures no spread between runs, so these runs do not rank the rules: --seeds 2 or more "
                "would")
    if any(high < low for _, high in ranges for low, _ in ranges):
        return None
    return ("every rule's seed range of steps ÷ tuned overlaps every other's, so these runs do not rank the rules: "
            "more --seeds, or global batches further apart, would")


def _beats_tuned_warnings(card: dict[str, dict]) -> list[str]:
    """Where a rule's every seed reached the target before every seed of the best tuned setting."""
    out = []
    for rule, scores in card.items():
        for beat in scores["beats_tuned"]:
            variant = f" with {beat['tuned_variant']}'s settings" if beat["tuned_variant"] else ""
            out.append(f"rule {rule} beat the best tuned setting at global batch {beat['global_batch_size']} beyond "
                       f"the seeds' spread ({beat['steps'][0]:g} to {beat['steps'][1]:g} steps against "
                       f"{beat['tuned_steps'][0]:g} to {beat['tuned_steps'][1]:g} at lr {beat['tuned_lr']:g}"
                       f"{variant}): the sweep missed a better setting there, so tuned is no ground truth at that "
                       "batch; a finer --sweep-factor would tell")
    return out


def tied_best(config: StudyConfig, view: BatchRuns) -> list[float]:
    """The sweep's other lrs at this batch whose median steps are within one evaluation interval of the best's:
    which of them is best is then not measured (the steps to target are read every ``eval_every`` steps)."""
    sweep_rule = registry.sweeping(config)
    if view.best is None or sweep_rule is None:
        return []
    tied = []
    for lr, names in view.lrs.items():
        if sweep_rule.name not in names or lr == view.best.lr:
            continue
        runs = view.seeds_at(lr, view.best.variant) if all(
            (lr, s, view.best.variant) in view.fixed for s in range(config.seeds)) else []
        median = fit.median([steps(r) for r in runs]) if runs else math.inf
        if abs(median - view.best.median_steps) < config.eval_every:
            tied.append(lr)
    return sorted(tied)


def _tie_warnings(config: StudyConfig, batches: dict[int, BatchRuns], ties: dict[int, list[float]]) -> list[str]:
    seeds = f"{config.seeds} seed{'s' if config.seeds > 1 else ''}"
    return [f"at global batch {b} the best tuned lr {batches[b].best.lr:g} ties with "
            f"{', '.join(f'{lr:g}' for lr in tied)} ({batches[b].best.median_steps:g} median steps, read every "
            f"{config.eval_every} steps over {seeds}): which is best is not measured there; evaluate more often "
            "(--eval-every 1) or add seeds (--seeds)" for b, tied in sorted(ties.items())]


def lr_peak(config: StudyConfig, tuned: list[dict], b_simple: dict | None,
            ties: dict[int, list[float]] | None = None) -> dict | None:
    """Adam-family studies: the smallest batch where the best tuned lr is highest, where that is inside the measured
    range (the best lrs at the smallest and the largest batch are both lower; else None), and B_simple at the
    reference batch (Li et al. 2024 place the peak at B_noise). None for SGD. A peak whose best lr ties with a lower
    one (``ties``) is none: the data do not separate them."""
    if not config.optimizer.adam:
        return None
    points = sorted((p["global_batch_size"], p["lr"]) for p in tuned)
    peak = None
    if len(points) >= 3:
        top = max(lr for _, lr in points)
        if points[0][1] < top and points[-1][1] < top:
            peak = next(b for b, lr in points if lr == top)
            ties = ties or {}
            # Only where the data separate them: the ends' best lrs below the top, the top above its own ties.
            if any(lr < top for lr in ties.get(peak, [])) or any(lr >= top for end in (points[0][0], points[-1][0])
                                                                for lr in ties.get(end, [])):
                peak = None
    reference = next((at["value"] for at in (b_simple or {}).get("by_batch", [])
                      if at["global_batch_size"] == config.reference_global_batch_size), None)
    return {"global_batch_size": peak, "b_simple": reference}
