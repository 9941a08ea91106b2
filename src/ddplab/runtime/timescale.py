"""How much longer than usual this machine may take: one factor for every bound ddplab waits on an event with.

ddplab waits on events (a rank's exit, a file, a peer's answer); where such a wait needs an outer bound (a live
rank's stack dump, the grace a stopped rank gets), the bound is a usual duration times :func:`factor`, so a slow
or loaded machine gets a slower answer rather than a wrong or missing one. ``DDPLAB_TIME_SCALE`` sets the factor
(default 1); the test suite sets it from how long ``import torch`` took. Torch-free.
"""

from __future__ import annotations

import os

ENV = "DDPLAB_TIME_SCALE"


def factor() -> float:
    """``DDPLAB_TIME_SCALE`` as a number of at least 1 (1 when unset or not a positive number)."""
    try:
        value = float(os.environ.get(ENV, "1"))
    except ValueError:
        return 1.0
    return max(1.0, value) if value == value else 1.0  # NaN reads as unset


def scaled(seconds: float) -> float:
    """``seconds`` on this machine: the usual bound times :func:`factor`."""
    return seconds * factor()
