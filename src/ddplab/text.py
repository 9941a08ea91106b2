"""How ddplab's sentences write quantities (torch-free)."""

from __future__ import annotations

import math


def count(n: float, noun: str, plural: str | None = None) -> str:
    """'1 device', '8 devices', '2.5 epochs', '1281167 samples' (an integer in full)."""
    shown = f"{n:g}" if isinstance(n, float) else str(n)
    return f"{shown} {noun}" if n == 1 else f"{shown} {plural or noun + 's'}"


def num(value: float, digits: int = 4) -> str:
    """A number for a table: fixed point when readable, scientific when tiny or huge."""
    if value == 0 or not math.isfinite(value):
        return str(value if value else 0)
    if 1e-3 <= abs(value) < 1e6:
        return f"{value:.{digits}f}".rstrip("0").rstrip(".") if abs(value) >= 1 else f"{value:.{digits + 2}f}"
    return f"{value:.{digits - 1}e}"


def num_or_dash(value: float | None) -> str:
    """:func:`num`, or a dash where there is no value."""
    return "—" if value is None else num(value)
