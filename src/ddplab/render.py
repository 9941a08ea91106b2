"""Shared output helpers: rich for people, one JSON object for scripts."""

from __future__ import annotations

import json
import math
import sys
from typing import Any


def console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Piped output (docs, CI logs) gets room for a table instead of rich's 80-column default.
    width = None if stream.isatty() else 120
    return Console(stderr=stderr, highlight=False, width=width)


def print_json(obj: Any) -> None:
    """One standard JSON object: inf and nan, which JSON cannot hold, are written as null."""
    json.dump(_standard(obj), sys.stdout, indent=2, allow_nan=False)
    sys.stdout.write("\n")


def _standard(value: Any) -> Any:
    if hasattr(value, "to_json"):
        return _standard(value.to_json())
    if isinstance(value, dict):
        return {key: _standard(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_standard(item) for item in value]
    if isinstance(value, float):
        # json.dump would write NaN / Infinity, which strict parsers (JavaScript, jq) reject.
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int, bool)):
        return value
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def num(value: float, digits: int = 4) -> str:
    """A number for a table: fixed point when readable, scientific when tiny or huge."""
    if value == 0 or not math.isfinite(value):
        return str(value if value else 0)
    if 1e-3 <= abs(value) < 1e6:
        return f"{value:.{digits}f}".rstrip("0").rstrip(".") if abs(value) >= 1 else f"{value:.{digits + 2}f}"
    return f"{value:.{digits - 1}e}"


def table(title: str, columns: list[str], rows: list[list[str]]):
    """A titled table; the title is its own line, so it never wraps to the table's width."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    out = Table()
    for column in columns:
        out.add_column(column, overflow="fold")
    for row in rows:
        out.add_row(*row)
    return Group(Text(title, style="bold"), out)
