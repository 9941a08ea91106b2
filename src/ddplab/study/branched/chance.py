"""How often the default tolerance lets a batch match by noise (torch-free).

The default tolerance is half the range of the reference batch's seeds, and a batch matches when its median end
loss is at most the reference's median plus that. With each seed's end loss normal around its batch's mean with the
same spread σ (the seeds' noise), a batch whose mean is worse by Δ = d·σ still matches with a probability that
depends only on d and the number of seeds. With two seeds it is exact: the two medians' difference is normal
(mean Δ, variance σ²) and independent of the reference's half range |r₁ − r₂|/2, so
P = E[Φ(|N|/√2 − d)] over a standard normal N; at d = 0 that is 1/2 + atan(1/√2)/π ≈ 0.696.
Other seed counts are simulated, with a fixed generator, so the figure is the same on every machine.
"""

from __future__ import annotations

import math
import random
import statistics


def exact_two_seeds(d: float, points: int = 4000) -> float:
    """P(match) with 2 seeds for a batch d σ worse: E[Φ(|N|/√2 − d)], by the midpoint rule on |N|'s density.

    >>> round(exact_two_seeds(0.0), 4), round(0.5 + math.atan(1 / math.sqrt(2)) / math.pi, 4)
    (0.6959, 0.6959)
    """
    top = 10.0
    width = top / points
    total = 0.0
    for i in range(points):
        u = (i + 0.5) * width
        total += 2 * _phi(u) * _cdf(u / math.sqrt(2) - d) * width
    return total


def simulated(d: float, seeds: int, trials: int = 20000, generator_seed: int = 0) -> float:
    """P(match) for ``seeds`` seeds, a batch d σ worse, by simulation (the same figure on every machine)."""
    rng = random.Random(generator_seed)
    hits = 0
    for _ in range(trials):
        reference = [rng.gauss(0.0, 1.0) for _ in range(seeds)]
        batch = [rng.gauss(d, 1.0) for _ in range(seeds)]
        tolerance = (max(reference) - min(reference)) / 2
        hits += statistics.median(batch) <= statistics.median(reference) + tolerance
    return hits / trials


def _phi(x: float) -> float:
    return math.exp(-x * x / 2) / math.sqrt(2 * math.pi)


def _cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))
