"""Gradient noise scale estimators (McCandlish et al. 2018), pure Python.

From the squared norm of a gradient over B_small samples and one over B_big samples:

    |G|²  ≈ (B_big·|G_big|² − B_small·|G_small|²) / (B_big − B_small)
    tr(Σ) ≈ (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)
    B_simple = tr(Σ) / |G|²

Each step's pair is unbiased but noisy; B_simple averages numerator and denominator
separately (EMA for a running value, window means for the summary).
"""

from __future__ import annotations

import dataclasses
import math

# Two-sided 95% Student-t quantiles by degrees of freedom (normal beyond the table).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 25: 2.060, 30: 2.042}


def t95(dof: int) -> float:
    """The 97.5% quantile of Student's t with ``dof`` degrees of freedom."""
    if dof in _T95:
        return _T95[dof]
    below = [d for d in _T95 if d < dof]
    return _T95[max(below)] if dof <= 30 else 1.96


def unbiased_estimates(g_small_sq: float, g_big_sq: float, b_small: float, b_big: float) -> tuple[float, float]:
    """(|G|², tr Σ) from one pair of squared gradient norms."""
    if not b_big > b_small > 0:
        raise ValueError(f"need 0 < B_small < B_big, got {b_small} and {b_big}")
    g2 = (b_big * g_big_sq - b_small * g_small_sq) / (b_big - b_small)
    trace = (g_small_sq - g_big_sq) / (1.0 / b_small - 1.0 / b_big)
    return g2, trace


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
    """B_simple over a window of steps, with a 95% interval from batch means."""

    b_simple: float
    b_simple_ci95: tuple[float, float]
    g2: float
    trace_sigma: float
    steps: int

    def steps_factor(self, global_batch: float) -> float:
        """Predicted steps relative to the fewest possible at this global batch: 1 + B_simple/B."""
        return 1.0 + self.b_simple / global_batch

    def adascale_gain(self, scale: float, base_batch: float) -> float:
        """AdaScale's gain r = (σ² + μ²)/(σ²/S + μ²), σ² the variance at ``base_batch``; the lr multiplier it implies."""
        sigma2, mu2 = self.trace_sigma / base_batch, max(self.g2, 0.0)
        return (sigma2 + mu2) / (sigma2 / scale + mu2)


def summarize(g2s: list[float], traces: list[float], *, n_batches: int = 20) -> Summary:
    """Window estimate tr Σ / |G|² (ratio of means) and a batch-means interval for it."""
    steps = len(g2s)
    if steps == 0:
        raise ValueError("no measured steps to summarize")
    g2, trace = sum(g2s) / steps, sum(traces) / steps
    ratio = trace / g2 if g2 > 0 else math.inf
    n_batches = min(n_batches, steps)
    if n_batches < 2 or not math.isfinite(ratio):
        return Summary(ratio, (-math.inf, math.inf), g2, trace, steps)
    size = steps // n_batches
    # Linearised ratio estimator: the spread of tr − R·|G|² over batch means.
    residuals = [(sum(traces[i * size:(i + 1) * size]) - ratio * sum(g2s[i * size:(i + 1) * size])) / size
                 for i in range(n_batches)]
    mean_residual = sum(residuals) / n_batches
    variance = sum((r - mean_residual) ** 2 for r in residuals) / (n_batches - 1)
    half = t95(n_batches - 1) * math.sqrt(variance / n_batches) / g2
    return Summary(ratio, (ratio - half, ratio + half), g2, trace, steps)
