"""Steps-to-target versus global batch: the fit S(B) = S_min(1 + B_crit/B), pure Python (no torch).

McCandlish et al. (2018) predict that the steps S a run needs to reach a target fall with the
global batch B as S = S_min(1 + B_crit/B), and the samples E = S·B rise as E = E_min(1 + B/B_crit)
with E_min = S_min·B_crit. Shallue et al. (2019) name the three regimes the curve passes through:
perfect scaling (S ∝ 1/B, B ≪ B_crit), diminishing returns, and no further gain (B ≫ B_crit).

Also here: medians over seeds, the tuned lr curve and the seed bootstrap.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence

from ddplab.errors import UsageError

# Below B_crit/4 halving the batch still costs ≥ 1.67× the steps (2× is perfect scaling);
# above 4·B_crit doubling it saves ≤ 10%.
PERFECT_BELOW = 0.25
NO_GAIN_ABOVE = 4.0


@dataclasses.dataclass(frozen=True)
class Fit:
    """S(B) = s_min·(1 + b_crit/B); b_crit is inf when the measured range shows no bend, 0 when no gain at all."""

    s_min: float
    b_crit: float

    def steps(self, global_batch: float) -> float:
        return self.s_min * (1.0 + self.b_crit / global_batch) if math.isfinite(self.b_crit) else math.inf

    @property
    def e_min(self) -> float:
        """The fewest samples to reach the target (B → 0): S_min·B_crit."""
        return self.s_min * self.b_crit


def front_samples(steps: float, s_min: float, e_min: float) -> float | None:
    """The samples the fitted Pareto front (S/S_min − 1)(E/E_min − 1) = 1 needs to reach the target in ``steps``:
    E = E_min·(1 + 1/(S/S_min − 1)). None where S ≤ S_min (the front reaches no such S), S is not finite, or the
    fit has no front (S_min or E_min not a positive number).

    >>> front_samples(200.0, 100.0, 3000.0), front_samples(400.0, 100.0, 3000.0)
    (6000.0, 4000.0)
    >>> front_samples(100.0, 100.0, 3000.0) is None, front_samples(float("inf"), 100.0, 3000.0) is None
    (True, True)
    """
    usable = all(math.isfinite(x) and x > 0 for x in (s_min, e_min)) and math.isfinite(steps)
    if not usable or steps <= s_min:
        return None
    return e_min * (1 + 1 / (steps / s_min - 1))


def fit_steps(global_batches: Sequence[float], steps: Sequence[float], *, iterations: int = 50) -> Fit:
    """Fit S = a + b/B (a = S_min, b = S_min·B_crit) in relative error, a ≥ 0 and b ≥ 0.

    Iteratively reweighted least squares with weights 1/Ŝ²: step counts spread over decades,
    so each point's relative error counts, not its absolute size. Exact data is recovered exactly.
    """
    points = [(1.0 / b, s) for b, s in zip(global_batches, steps) if math.isfinite(s) and s > 0]
    if len(points) < 2:
        raise UsageError("the fit needs steps at two or more global batch sizes")
    fitted = [s for _, s in points]
    a = b = 0.0
    for _ in range(iterations):
        weights = [1.0 / f ** 2 for f in fitted]
        a, b = _weighted_line(points, weights)
        if b < 0:
            # Larger batches never helped: S is flat, B_crit = 0.
            a, b = sum(w * s for w, (_, s) in zip(weights, points)) / sum(weights), 0.0
        elif a <= 0:
            # No bend within the measured range: perfect scaling throughout, B_crit unbounded.
            b, a = (sum(w * s * x for w, (x, s) in zip(weights, points))
                    / sum(w * x * x for w, (x, _) in zip(weights, points))), 0.0
        fitted = [a + b * x for x, _ in points]
    # An S_min of rounding size (perfect scaling fitted in floating point) is no bend either, not a B_crit of 1e17.
    if a <= 1e-9 * max(s for _, s in points):
        return Fit(s_min=0.0, b_crit=math.inf)
    return Fit(s_min=a, b_crit=b / a)


def _weighted_line(points: list[tuple[float, float]], weights: list[float]) -> tuple[float, float]:
    sw = sum(weights)
    mx = sum(w * x for w, (x, _) in zip(weights, points)) / sw
    my = sum(w * s for w, (_, s) in zip(weights, points)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, (x, _) in zip(weights, points))
    if sxx == 0:
        return my, 0.0
    slope = sum(w * (x - mx) * (s - my) for w, (x, s) in zip(weights, points)) / sxx
    return my - slope * mx, slope


def ratio(value: float, reference: float | None) -> float | None:
    """value / reference where both are finite numbers, else None (JSON null)."""
    ok = reference and math.isfinite(value) and math.isfinite(reference)
    return value / reference if ok else None


def median(values: Sequence[float]) -> float:
    """Median where a run that never reached the target counts as inf (so it can be the median)."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return math.inf
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(fewest, median, most) over seeds, a run that never arrived counting as inf: the error bar of a point."""
    ordered = sorted(values)
    return (ordered[0], median(ordered), ordered[-1]) if ordered else (math.inf, math.inf, math.inf)


def fit_seeds(steps_by_batch: dict[int, list[float]], *, n_boot: int = 1000, seed: int = 0) -> dict:
    """Fit the median over seeds, and a 95% bootstrap interval for B_crit resampling seeds.

    ``steps_by_batch[B][i]`` is seed i's steps at batch B (inf when not reached); seed i is the
    unit resampled, so one draw keeps a seed's runs together across batch sizes.
    """
    batches = sorted(steps_by_batch)
    medians = {b: median(steps_by_batch[b]) for b in batches}
    fit = fit_steps(batches, [medians[b] for b in batches])
    n_seeds = min(len(steps_by_batch[b]) for b in batches)
    rng = random.Random(seed)
    draws, fitted = [], []
    for _ in range(n_boot if n_seeds > 1 else 0):
        picks = [rng.randrange(n_seeds) for _ in range(n_seeds)]
        resampled = [median([steps_by_batch[b][i] for i in picks]) for b in batches]
        try:
            fitted.append(fit_steps(batches, resampled))
        except ValueError:
            continue
        draws.append(fitted[-1].b_crit)
    low, high = _percentiles(draws, 0.025, 0.975) if draws else (math.nan, math.nan)
    # The curve's own 95% band: at each batch, the middle 95% of the resampled fits' steps.
    band = {b: list(_percentiles([f.steps(b) for f in fitted], 0.025, 0.975)) if fitted else [math.nan, math.nan]
            for b in batches}
    return {"s_min": fit.s_min, "b_crit": fit.b_crit, "b_crit_ci95": [low, high], "e_min": fit.e_min,
            "median_steps": {b: medians[b] for b in batches}, "regimes": regimes(fit.b_crit),
            "seed_range": {b: [spread(steps_by_batch[b])[0], spread(steps_by_batch[b])[2]] for b in batches},
            "band": band}


def _percentiles(values: list[float], *quantiles: float) -> tuple[float, ...]:
    ordered = sorted(values)
    return tuple(ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] for q in quantiles)


def bound_reading(bound: dict[str, int]) -> str:
    """``{"below": 32}`` as "B_crit < 32", ``{"above": 128}`` as "B_crit > 128"."""
    side, edge = next(iter(bound.items()))
    return f"B_crit {'<' if side == 'below' else '>'} {edge}"


def regimes(b_crit: float) -> dict[str, float]:
    """Where perfect scaling ends and where a larger batch stops paying."""
    return {"perfect_scaling_below": b_crit * PERFECT_BELOW, "no_further_gain_above": b_crit * NO_GAIN_ABOVE}


def best_lr(steps_by_lr: dict[float, list[float]]) -> tuple[float, float] | None:
    """(lr, median steps) with the fewest median steps over seeds; None when no lr reached the target."""
    scored = sorted((median(steps), lr) for lr, steps in steps_by_lr.items())
    if not scored or not math.isfinite(scored[0][0]):
        return None
    return scored[0][1], scored[0][0]
