"""Gradient noise scale estimators (McCandlish et al. 2018), pure Python.

Sampling model. A dataset of N examples has per-example gradients g_i, true gradient
G = (1/N) Σ g_i and per-example covariance Σ = (1/N) Σ (g_i − G)(g_i − G)ᵀ (the 1/N
convention: Σ is the covariance of one uniformly drawn example's gradient, so
B_simple = tr Σ / |G|² is what sampling with replacement would see). A batch of B examples
drawn WITHOUT replacement (one shuffled epoch, as DistributedSampler and a shuffled
DataLoader draw them) has mean G_B with

    E|G_B|² = |G|² + c(B)·tr Σ,    c(B) = (1/B)·(N − B)/(N − 1)

(the finite-population correction; c(B) → 1/B as N → ∞). From the squared norms over a small
batch b (each rank's) and a big one B (the all-reduced average), solving the two equations gives
unbiased estimates:

    tr Σ ≈ (|G_b|² − |G_B|²) / (c(b) − c(B))
    |G|² ≈ |G_B|² − c(B)·tr Σ

With N = ∞ these are the textbook (B·|G_B|² − b·|G_b|²)/(B − b) and (|G_b|² − |G_B|²)/(1/b − 1/B).
On a finite dataset the textbook |G|² is low by tr Σ/(N − 1), so B_simple reads high by about
B_simple/N: pass ``dataset_size`` when batches come from one shuffled pass over N examples; leave
it out when they are drawn with replacement or from a stream.

Interval. Each step's pair is unbiased but noisy, and |G|² is usually the hard part: when
B_simple ≫ the global batch its per-step estimate is mostly noise. B_simple is the ratio of the
window means, tr Σ̄ / |G|²̄; its 95% interval is Fieller's: the set of R whose linear contrast
tr Σ − R·|G|² is consistent with zero, |mean| ≤ t·se, with the (co)variances of the two means
from batch means over consecutive steps (t with batches − 1 degrees of freedom). Unlike the
delta method it stays honest when |G|²̄ is small against its error: the set is then unbounded
above ("|G|² not resolved: B_simple > X at 95%"), and it is clipped to B_simple ≥ 0.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

# Two-sided 95% Student-t quantiles by degrees of freedom (normal beyond the table).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 25: 2.060, 30: 2.042}

Status = Literal["resolved", "g2_unresolved", "no_interval", "inconsistent"]


def t95(dof: int) -> float:
    """The 97.5% quantile of Student's t with ``dof`` degrees of freedom."""
    if dof in _T95:
        return _T95[dof]
    below = [d for d in _T95 if d < dof]
    return _T95[max(below)] if dof <= 30 else 1.96


def batch_factor(batch: float, dataset_size: int | None = None) -> float:
    """c(B): the variance of a batch mean over B examples is c(B)·Σ (sampled without replacement from N)."""
    if dataset_size is None:
        return 1.0 / batch
    return (dataset_size - batch) / (batch * (dataset_size - 1))


def unbiased_estimates(g_small_sq: float, g_big_sq: float, b_small: float, b_big: float,
                       dataset_size: int | None = None) -> tuple[float, float]:
    """(|G|², tr Σ) from one pair of squared norms; ``dataset_size`` N when batches are drawn without replacement."""
    if not b_big > b_small > 0:
        raise ValueError(f"need 0 < B_small < B_big, got {b_small} and {b_big}")
    if dataset_size is not None and not dataset_size >= max(b_big, 2):
        raise ValueError(f"dataset_size must be at least the big batch {b_big}, got {dataset_size}")
    c_small, c_big = batch_factor(b_small, dataset_size), batch_factor(b_big, dataset_size)
    trace = (g_small_sq - g_big_sq) / (c_small - c_big)
    return g_big_sq - c_big * trace, trace


@dataclasses.dataclass
class Ema:
    """Exponential moving average with bias correction (as in Adam)."""

    decay: float = 0.95
    value: float = 0.0
    count: int = 0

    def update(self, x: float) -> float:
        self.count += 1
        self.value = self.decay * self.value + (1.0 - self.decay) * x
        return self.get()

    def get(self) -> float:
        return self.value / (1.0 - self.decay ** self.count) if self.count else float("nan")


@dataclasses.dataclass(frozen=True)
class Summary:
    """B_simple over a window of steps, with Fieller's 95% interval.

    ``b_simple`` is math.inf when the mean |G|² estimate is ≤ 0; ``b_simple_ci95`` is None with
    fewer than 2 steps (or when no B_simple ≥ 0 fits the data), and its upper end is math.inf
    when |G|² is not resolved.
    """

    b_simple: float
    b_simple_ci95: tuple[float, float] | None
    g2: float
    trace_sigma: float
    steps: int

    @property
    def status(self) -> Status:
        if self.b_simple_ci95 is None:
            return "no_interval" if self.steps < 2 else "inconsistent"
        return "resolved" if math.isfinite(self.b_simple_ci95[1]) else "g2_unresolved"

    def describe(self) -> str | None:
        """One sentence when the estimate needs a caveat; None when the interval is finite."""
        if self.status == "no_interval":
            return (f"{self.steps} measured step: no interval; measure at least 2 steps (more --steps or a "
                    "smaller --every)")
        if self.status == "inconsistent":
            return ("the |G|² and tr(Σ) estimates fit no B_simple ≥ 0 (|G|² or tr(Σ) significantly negative): "
                    "the batches do not match the sampling model (batch sizes, repeated samples, rank-dependent data)")
        if self.status == "g2_unresolved":
            return (f"|G|² not resolved: B_simple > {self.b_simple_ci95[0]:.4g} at 95% "
                    f"(the mean |G|² estimate {self.g2:.4g} is within its error of 0); measure more steps")
        return None

    def steps_factor(self, global_batch: float) -> float:
        """Predicted steps relative to the fewest possible at this global batch: 1 + B_simple/B."""
        return 1.0 + self.b_simple / global_batch


def summarize(g2s: list[float], traces: list[float], *, n_batches: int = 20) -> Summary:
    """Window estimate tr Σ̄ / |G|²̄ (ratio of means) and Fieller's 95% interval from batch means."""
    steps = len(g2s)
    if steps == 0:
        raise ValueError("no measured steps to summarize")
    g2, trace = sum(g2s) / steps, sum(traces) / steps
    b_simple = max(trace, 0.0) / g2 if g2 > 0 else math.inf
    n_batches = min(n_batches, steps)
    if n_batches < 2:
        return Summary(b_simple, None, g2, trace, steps)
    v_xx, v_xy, v_yy = _covariance_of_means(g2s, traces, n_batches)
    interval = fieller(g2, trace, v_xx, v_xy, v_yy, t95(n_batches - 1))
    return Summary(b_simple, interval, g2, trace, steps)


def _covariance_of_means(xs: list[float], ys: list[float], n_batches: int) -> tuple[float, float, float]:
    """Var(x̄), Cov(x̄, ȳ), Var(ȳ) of the window means, from the spread of means over consecutive batches."""
    steps, size = len(xs), len(xs) // n_batches
    # Batch means absorb the correlation between nearby steps (one epoch's batches, drifting weights).
    means = [(sum(xs[i * size:(i + 1) * size]) / size, sum(ys[i * size:(i + 1) * size]) / size)
             for i in range(n_batches)]
    mx = sum(m[0] for m in means) / n_batches
    my = sum(m[1] for m in means) / n_batches
    # A batch mean has variance σ²/size; the window mean over all steps σ²/steps.
    scale = size / steps / (n_batches - 1)
    return (scale * sum((x - mx) ** 2 for x, _ in means), scale * sum((x - mx) * (y - my) for x, y in means),
            scale * sum((y - my) ** 2 for _, y in means))


def fieller(x: float, y: float, v_xx: float, v_xy: float, v_yy: float, t: float) -> tuple[float, float] | None:
    """Fieller's set for R = E[y]/E[x] within [0, ∞]: {R : (y − R·x)² ≤ t²·Var(y − R·x)}, as an interval.

    Returns (low, high), high = math.inf when x is not significantly positive (the set reaches x = 0);
    None when no R ≥ 0 is in the set.
    """
    a, b, c = x * x - t * t * v_xx, x * y - t * t * v_xy, y * y - t * t * v_yy
    # The set is {R : a·R² − 2b·R + c ≤ 0}.
    disc = b * b - a * c
    if a > 0:
        root = math.sqrt(max(disc, 0.0))
        low, high = (b - root) / a, (b + root) / a
        return (max(low, 0.0), high) if high >= 0 else None
    if disc <= 0 or (a == 0 and b <= 0):
        return 0.0, math.inf
    if a == 0:
        return max(c / (2 * b), 0.0), math.inf
    # a < 0: two rays, R ≤ (b + √disc)/a and R ≥ (b − √disc)/a; their hull within [0, ∞].
    lower_ray_end, upper_ray_start = (b + math.sqrt(disc)) / a, (b - math.sqrt(disc)) / a
    return (0.0 if lower_ray_end >= 0 else max(upper_ray_start, 0.0)), math.inf
