"""The closed form against brute-force numeric integration (pure Python, no torch)."""

import math

import pytest

from ddplab.sandbox import theory


def _brute_force_moments(w: float, points: int = 40_000) -> tuple[float, float]:
    # Condition on x: P(y < w·x) = Φ(w·x), so E[sign(wx − y)·x | x] = x·(2Φ(wx) − 1).
    lo, hi = 1.0 - 12.0, 1.0 + 12.0
    step = (hi - lo) / points
    mean = second = 0.0
    for i in range(points):
        x = lo + (i + 0.5) * step
        density = theory.normal_pdf(x - 1.0) * step
        mean += x * (2.0 * theory.normal_cdf(w * x) - 1.0) * density
        second += x * x * density
    return mean, second - mean * mean


@pytest.mark.parametrize("w", [1.0, 0.5, -0.3, 2.0, 0.0])
def test_closed_form_matches_numeric_integration(w):
    mean, variance = _brute_force_moments(w)
    assert theory.gradient_mean(w, deterministic=False) == pytest.approx(mean, abs=1e-9)
    assert theory.gradient_variance(w, deterministic=False) == pytest.approx(variance, abs=1e-9)


def test_deterministic_prediction_is_exact():
    assert theory.predict(lr=1e-3, batch_size=128, steps=2, deterministic=True) == theory.Prediction(0.998, 0.0)
    assert theory.predict(lr=8e-3, batch_size=128, steps=2, deterministic=True).w == pytest.approx(0.984, abs=1e-15)


def test_update_variance_scales_with_lr_squared_over_batch():
    base = theory.predict(lr=1e-3, batch_size=16, steps=1, deterministic=False)
    linear = theory.predict(lr=8e-3, batch_size=128, steps=1, deterministic=False)
    root = theory.predict(lr=1e-3 * math.sqrt(8), batch_size=128, steps=1, deterministic=False)
    assert linear.update_step_variance == pytest.approx(8 * base.update_step_variance, rel=1e-12)
    assert root.update_step_variance == pytest.approx(base.update_step_variance, rel=1e-12)
