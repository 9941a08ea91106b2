"""How ddplab's sentences write quantities (torch-free)."""

from __future__ import annotations


def count(n: float, noun: str, plural: str | None = None) -> str:
    """'1 device', '8 devices', '2.5 epochs', '1281167 samples' (an integer in full)."""
    shown = f"{n:g}" if isinstance(n, float) else str(n)
    return f"{shown} {noun}" if n == 1 else f"{shown} {plural or noun + 's'}"
