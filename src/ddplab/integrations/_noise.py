"""What every framework's noise-scale callback does once its optimizer step's gradients are reduced."""

from __future__ import annotations


def measure(noise_scale, step: int, history: list[dict]) -> dict[str, float] | None:
    """Close one optimizer step; on a measured step, append it to ``history`` and return the values to log."""
    record = noise_scale.step() if noise_scale is not None else None
    if record is None:
        return None
    values = {"b_simple": record.b_simple_ema, "grad_sq_norm": record.g2, "trace_sigma": record.trace_sigma}
    history.append({"step": step, "g_small_sq": record.g_small_sq, "g_big_sq": record.g_big_sq, **values})
    return values
