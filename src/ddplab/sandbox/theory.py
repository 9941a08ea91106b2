"""Closed-form predictions for the sandbox's one-neuron problem (pure Python, no torch).

Model w·x, L1 loss |w·x − y|, so one sample's gradient is g = sign(w·x − y)·x.
Noisy data: x = 1 + N(0,1), y = N(0,1), independent. With u = w·x − y, (x, u) is jointly
Gaussian with Var u = w² + 1 and Cov(x, u) = w, which gives

    E[g]   = 2Φ(a) − 1 + 2a·φ(a),      a = w / √(w² + 1)
    Var[g] = E[x²] − E[g]² = 2 − E[g]²

A step with a global batch of B averages B independent gradients, so the update
lr·ḡ has mean lr·E[g] and variance lr²·Var[g]/B.

AdaScale's gain at S times a reference batch b is r = (σ² + μ²)/(σ²/S + μ²) with σ² = Var[g]/b and
μ² = E[g]²; the sandbox draws each epoch's N samples afresh and shards them without replacement,
so what a measurement on its batches estimates is the epoch's own mean and variance, whose
expectations are μ² + Var[g]/N and Var[g]·(N − 1)/N.
"""

from __future__ import annotations

import dataclasses
import math

from ddplab.adapt import gain as adascale


def normal_cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def normal_pdf(z: float) -> float:
    return math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


def gradient_mean(w: float, *, deterministic: bool) -> float:
    """E[g] for one sample at weight w."""
    if deterministic:
        # x = 1, y = 0: g = sign(w).
        return float((w > 0) - (w < 0))
    a = w / math.sqrt(w * w + 1.0)
    return 2.0 * normal_cdf(a) - 1.0 + 2.0 * a * normal_pdf(a)


def gradient_variance(w: float, *, deterministic: bool) -> float:
    """Var[g] for one sample at weight w."""
    if deterministic:
        return 0.0
    return 2.0 - gradient_mean(w, deterministic=False) ** 2


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Theory for one sandbox run."""

    w: float
    """Mean of w over experiments after training."""
    update_step_variance: float
    """Variance of lr × (batch-mean gradient), pooled over steps and experiments."""


def predict(*, lr: float, batch_size: int, steps: int, deterministic: bool, w0: float = 1.0) -> Prediction:
    """Mean-field prediction: iterate w ← w − lr·E[g(w)] and pool the per-step variances.

    ``batch_size`` is the number of samples averaged into one update: the global batch
    under DDP, the per-rank batch when ranks train alone.
    """
    w = w0
    means, variances = [], []
    for _ in range(steps):
        mean = gradient_mean(w, deterministic=deterministic)
        means.append(lr * mean)
        variances.append(lr * lr * gradient_variance(w, deterministic=deterministic) / batch_size)
        w -= lr * mean
    if steps == 0 or deterministic:
        return Prediction(w=w, update_step_variance=0.0)
    grand_mean = sum(means) / steps
    # Pooled variance = mean within-step variance + spread of the step means.
    between = sum((m - grand_mean) ** 2 for m in means) / steps
    return Prediction(w=w, update_step_variance=sum(variances) / steps + between)


def adascale_gain(*, lr: float, batch_size: int, scale: float, steps: int, deterministic: bool,
                  dataset_size: int | None = None, w0: float = 1.0) -> float:
    """AdaScale's gain at ``scale`` times ``batch_size``, from E[g] and Var[g] averaged along the mean-field run.

    With ``dataset_size`` N, the expectation of what batches drawn without replacement from each
    epoch's N fresh samples measure (see the module's docstring); without it, the gain of infinite data.
    """
    w, mu2, sigma2 = w0, 0.0, 0.0
    for _ in range(max(steps, 1)):
        mean = gradient_mean(w, deterministic=deterministic)
        variance = gradient_variance(w, deterministic=deterministic)
        if dataset_size is not None:
            mean2, variance = mean * mean + variance / dataset_size, variance * (dataset_size - 1) / dataset_size
        else:
            mean2 = mean * mean
        mu2 += mean2 / max(steps, 1)
        sigma2 += variance / max(steps, 1)
        w -= lr * mean
    return adascale.gain(sigma2 / batch_size, mu2, scale)
