"""Shared output helpers: rich for people, one JSON object for scripts."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from typing import Any


def console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    columns = os.environ.get("COLUMNS", "")
    # COLUMNS wins, as in rich; piped output (docs, CI logs) gets room for a table instead of rich's 80 columns.
    width = int(columns) if columns.isdigit() else None if stream.isatty() else 120
    return Console(stderr=stderr, highlight=False, width=width)


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=_jsonable)
    sys.stdout.write("\n")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def num(value: float, digits: int = 4) -> str:
    """A number for a table: fixed point when readable, scientific when tiny or huge."""
    if value == 0 or not math.isfinite(value):
        return str(value if value else 0)
    if 1e-3 <= abs(value) < 1e6:
        return f"{value:.{digits}f}".rstrip("0").rstrip(".") if abs(value) >= 1 else f"{value:.{digits + 2}f}"
    return f"{value:.{digits - 1}e}"


def table(title: str, columns: list[str], rows: list[list[str]]):
    """A titled table (the title its own line) that wraps text but never splits a number across lines.

    Cells are rich markup. Column widths are chosen when the console's width is known: every column
    is at least as wide as its longest word with a digit in it, and short cells with a number
    (a value such as "0.12 ± 0.01") stay whole on one line; only text columns narrow below that.
    """
    return _NumberSafeTable(title, columns, rows)


# A "value" cell: a digit in at most this many cells of width stays on one line.
_VALUE_WIDTH = 24
_DIGIT = re.compile(r"\d")


class _NumberSafeTable:
    def __init__(self, title: str, columns: list[str], rows: list[list[str]]):
        self.title, self.columns, self.rows = title, list(columns), [list(row) for row in rows]

    def __rich_console__(self, console, options):
        from rich.table import Table
        from rich.text import Text

        header = [Text.from_markup(c) for c in self.columns]
        body = [[c if isinstance(c, Text) else Text.from_markup(str(c)) for c in row] for row in self.rows]
        cells = [[header[i]] + [row[i] for row in body if i < len(row)] for i in range(len(header))]
        out = Table()
        # Padding of 1 each side and one border per column, plus the right edge.
        room = options.max_width - 3 * len(header) - 1
        for column, width, value_like in zip(header, *_column_widths(cells, room)):
            out.add_column(column, width=width, no_wrap=value_like, overflow="fold")
        for row in body:
            out.add_row(*row)
        yield Text(self.title, style="bold")
        yield out


def _column_widths(cells: list[list], room: int) -> tuple[list[int], list[bool]]:
    """(width, never wrap) per column: natural widths, the widest narrowed first down to its floor."""
    natural = [max(_width(cell) for cell in column) for column in cells]
    # A column of short cells (values, yes/no, short labels) is never wrapped.
    value_like = [all(_width(cell) <= _VALUE_WIDTH for cell in column[1:]) for column in cells]
    floors = [width if whole else max(_floor(cell) for cell in column)
              for column, width, whole in zip(cells, natural, value_like)]
    widths = list(natural)
    while sum(widths) > room:
        shrinkable = [i for i, (width, floor) in enumerate(zip(widths, floors)) if width > floor]
        if not shrinkable:
            break  # narrower than the numbers themselves: rich folds what it must
        widths[max(shrinkable, key=lambda i: widths[i])] -= 1
    return widths, value_like


def _width(text) -> int:
    from rich.cells import cell_len

    return max((cell_len(line) for line in text.plain.split("\n")), default=0)


def _floor(text) -> int:
    """The narrowest a text cell may get: whole if it is a short value, else its longest word with a digit."""
    from rich.cells import cell_len

    if _DIGIT.search(text.plain) and _width(text) <= _VALUE_WIDTH:
        return _width(text)
    return max((cell_len(word) for word in text.plain.split() if _DIGIT.search(word)), default=1)
