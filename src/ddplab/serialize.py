"""Results as standard JSON: finite numbers only (inf and nan become null), written atomically."""

from __future__ import annotations

import json
import math
import os
from typing import Any


def finite(value: Any) -> Any:
    """``value`` with every non-finite float as None, tuples as lists and results by their ``to_json``."""
    if hasattr(value, "to_json"):
        return finite(value.to_json())
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    if isinstance(value, float):
        # JSON has no NaN or Infinity; strict parsers (JavaScript, jq) reject them.
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int, bool)):
        return value
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def dumps(value: Any, *, indent: int | None = 2) -> str:
    """One standard JSON document."""
    return json.dumps(finite(value), indent=indent, allow_nan=False)


def write_json_atomic(path: str, value: Any, *, standard: bool = True) -> None:
    """Write then rename: an interrupted command never leaves half a file.

    ``standard=False`` keeps inf and nan as Python's JSON writes them, for files only ddplab reads back.
    """
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(dumps(value, indent=None) if standard else json.dumps(value))
    os.replace(tmp, path)
