"""AdaScale's gain (Johnson et al. 2020), pure Python.

With σ² the variance of one reference-batch gradient and μ² = |G|² the squared norm of the true
gradient, a batch S times the reference averages S such gradients, and one step of it is worth

    r = E|g_ref|² / E|g_S|² = (σ² + μ²) / (σ²/S + μ²)

reference steps: 1 ≤ r ≤ S, 1 without noise (a larger batch buys nothing) and S with noise alone
(the linear rule). From the gradient noise scale's estimates, σ² = tr Σ / B_ref and μ² = |G|².
"""

from __future__ import annotations

import dataclasses


def gain(sigma2: float, mu2: float, scale: float) -> float:
    """r = (σ² + μ²)/(σ²/S + μ²), each estimate clipped at 0 (an estimate below 0 is noise around 0)."""
    sigma2, mu2 = max(sigma2, 0.0), max(mu2, 0.0)
    if sigma2 + mu2 == 0:
        return 1.0
    return (sigma2 + mu2) / (sigma2 / scale + mu2)


def default_smoothing(scale: float) -> float:
    """The paper's averaging factor θ = max(1 − S/1000, 0): a larger scale trusts each step's estimate more."""
    return max(1.0 - scale / 1000.0, 0.0)


@dataclasses.dataclass
class Smoothed:
    """Exponential moving averages of σ² and μ², debiased as Adam debiases (the paper's estimator)."""

    smoothing: float
    sigma2: float = 0.0
    mu2: float = 0.0
    weight: float = 0.0
    """1 − θ^n after n updates: what the averages are divided by."""

    def update(self, sigma2: float, mu2: float) -> None:
        theta = self.smoothing
        self.sigma2 = theta * self.sigma2 + (1 - theta) * sigma2
        self.mu2 = theta * self.mu2 + (1 - theta) * mu2
        self.weight = theta * self.weight + (1 - theta)

    def gain(self, scale: float) -> float:
        """The gain from the debiased averages; 1 before any update (no evidence of noise yet)."""
        if self.weight == 0:
            return 1.0
        return gain(self.sigma2 / self.weight, self.mu2 / self.weight, scale)

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)
