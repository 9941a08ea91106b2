"""Range checks for configuration values: each fails with one sentence that names the field (torch-free).

``field`` is the field's name as a caller wrote it (``"reference.lr"``); the sentence is a
:class:`~ddplab.errors.UsageError` template, so the command line shows the field as its flag.
None is "not given" and passes every check.
"""

from __future__ import annotations

import math
import re

from ddplab.errors import UsageError

_INTERVAL = re.compile(r"^([\[(])\s*(\S+),\s*(\S+)\s*([\])])$")


def at_least(field: str, value: float | None, minimum: int = 1) -> None:
    """``value >= minimum``: '{field} must be at least 1, got 0'."""
    # `not value >= minimum` also catches NaN.
    if value is not None and not value >= minimum:
        raise UsageError(f"{{{field}}} must be at least {minimum}, got {value}")


def positive(field: str, value: float | None, *, integer: bool = False) -> None:
    """A positive, finite number (a positive integer with ``integer``), and of a numeric type at all."""
    if value is None:
        return
    kind = "positive integer" if integer else "positive number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"{{{field}}} must be a {kind}, got {value!r} (a {type(value).__name__})")
    if integer and not (isinstance(value, int) and value > 0):
        raise UsageError(f"{{{field}}} must be a positive integer, got {value}")
    # `not 0 < value` also catches NaN; infinity is no size, rate or epoch count either.
    if not 0 < value < math.inf:
        raise UsageError(f"{{{field}}} must be a positive number, got {value}")


def zero_or_more(field: str, value: float | None) -> None:
    """A finite number ≥ 0: '{field} must be zero or more, got -1'."""
    if value is not None and not 0 <= value < math.inf:
        raise UsageError(f"{{{field}}} must be zero or more, got {value}")


def within(field: str, value: float | None, interval: str) -> None:
    """``value`` in ``interval``, written as the sentence shows it: ``"[0, 1)"``, ``"(0, 1]"``."""
    if value is None:
        return
    opening, low, high, closing = _INTERVAL.match(interval).groups()
    low, high = float(low), float(high)
    above = value >= low if opening == "[" else value > low
    below = value <= high if closing == "]" else value < high
    if not (above and below):
        raise UsageError(f"{{{field}}} must be in {interval}, got {value}")


def one_of(field: str, value, choices: tuple) -> None:
    """``value`` among ``choices``: '{field} must be one of a, b, got 'c''."""
    if value not in choices:
        raise UsageError(f"{{{field}}} must be one of {', '.join(map(str, choices))}, got {value!r}")
