"""Shared output helpers: rich for people, one JSON object for scripts, progress bars at a terminal."""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from ddplab import serialize
from ddplab.text import num  # noqa: F401 (the tables' number format, shared with the library's sentences)


def console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    columns = os.environ.get("COLUMNS", "")
    # COLUMNS wins, as in rich; piped output (docs, CI logs) gets room for a table instead of rich's 80 columns.
    width = int(columns) if columns.isdigit() else None if stream.isatty() else 120
    return Console(stderr=stderr, highlight=False, width=width)


def print_json(obj: Any) -> None:
    """One standard JSON object: inf and nan, which JSON cannot hold, are written as null."""
    sys.stdout.write(serialize.dumps(obj) + "\n")


class ProgressBar:
    """A rich progress bar for a person at a terminal; nothing for logs and pipes.

    A :class:`ddplab.progress.Progress` callback: it starts on its first call, in whichever process
    calls it (inside a rank: after the fork, so no thread is alive in a parent that forks), and
    closes when ``completed`` reaches ``total``.
    """

    def __init__(self, label: str, *, status: bool = False, unit: str | None = None):
        self.label, self.status, self.unit = label, status, unit
        self._bar = self._task = None
        self._logged = 0

    def __call__(self, completed: int, total: int, status: str = "") -> None:
        if not sys.stderr.isatty():
            self._log(completed, total, status)
            return
        if self._bar is None:
            self._start(total)
        self._bar.update(self._task, completed=completed, total=total, status=status)
        if completed >= total:
            self.close()

    def _log(self, completed: int, total: int, status: str) -> None:
        # Where jobs run (nohup, a Slurm log): a line per item finished, when the bar counts items.
        if self.unit is None or completed <= self._logged:
            return
        self._logged = completed
        print(f"{self.label}: {completed} of {total} {self.unit}{': ' + status if status else ''}", file=sys.stderr,
              flush=True)

    def _start(self, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        columns = [TextColumn(self.label), BarColumn(), MofNCompleteColumn()]
        if self.unit:
            columns.append(TextColumn(self.unit))
        columns.append(TimeRemainingColumn())
        if self.status:
            columns.append(TextColumn("{task.fields[status]}"))
        self._bar = Progress(*columns, console=console(stderr=True), transient=True)
        self._bar.start()
        self._task = self._bar.add_task(self.label, total=total, status="")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __getstate__(self):
        # Pickled into a spawned rank before it started: only the label travels.
        return {"label": self.label, "status": self.status, "unit": self.unit, "_bar": None, "_task": None,
                "_logged": 0}


def table(title: str, columns: list[str], rows: list[list[str]]):
    """A titled table (the title its own line) that wraps text but never splits a number across lines.

    Cells are rich markup. Widths are chosen once the console's width is known: short values
    (numbers, yes/no, "0.12 ± 0.01") stay whole, text wraps at spaces but never inside a word with a
    digit. When even that does not fit, each row prints as its own block of column: value lines.
    """
    return _NumberSafeTable(title, columns, rows)


# A value cell (a number, or one word) at most this wide stays whole on one line.
_VALUE_WIDTH = 24
_DIGIT = re.compile(r"\d")


class _NumberSafeTable:
    def __init__(self, title: str, columns: list[str], rows: list[list[str]]):
        self.title, self.columns, self.rows = title, list(columns), [list(row) for row in rows]

    def __rich_console__(self, console, options):
        from rich.text import Text

        header = [Text.from_markup(c) for c in self.columns]
        body = [[c if isinstance(c, Text) else Text.from_markup(str(c)) for c in row] for row in self.rows]
        yield Text(self.title, style="bold")
        yield _side_by_side(header, body, options.max_width) or _one_block_per_row(header, body, options.max_width)


def _side_by_side(header: list, body: list, max_width: int):
    """The usual table, or None when its numbers cannot all stay whole in ``max_width``."""
    from rich.table import Table

    cells = [[name] + [row[i] for row in body if i < len(row)] for i, name in enumerate(header)]
    sized = _column_widths(cells, _room(max_width, len(header)))
    if sized is None:
        return None
    out = Table()
    for name, (width, no_wrap) in zip(header, sized):
        out.add_column(name, width=width, no_wrap=no_wrap, overflow="fold")
    for row in body:
        out.add_row(*row)
    return out


def _one_block_per_row(header: list, body: list, max_width: int):
    """Each row as lines of column name and value, a rule between rows: for terminals too narrow for the table."""
    from rich.table import Table
    from rich.text import Text

    pairs = [(name, cell) for row in body for name, cell in zip(header, row)]
    cells = [[Text("")] + [name for name, _ in pairs], [Text("")] + [cell for _, cell in pairs]]
    sized = _column_widths(cells, _room(max_width, 2), force=True)
    out = Table(show_header=False)
    for width, no_wrap in sized:
        out.add_column(width=width, no_wrap=no_wrap, overflow="fold")
    for row in body:
        for j, (name, cell) in enumerate(zip(header, row)):
            out.add_row(name, cell, end_section=j == len(row) - 1)
    return out


def _room(max_width: int, columns: int) -> int:
    # Padding of 1 each side and one border per column, plus the right edge.
    return max_width - 3 * columns - 1


def _column_widths(cells: list[list], room: int, *, force: bool = False) -> list[tuple[int, bool]] | None:
    """(width, no_wrap) per column of [header, *cells]: natural widths, the widest narrowed first to its floor.

    None when the floors alone exceed ``room``, unless ``force`` (then rich folds what it must).
    """
    natural = [max(_width(cell) for cell in column) for column in cells]
    # A column of short values (numbers, yes/no) keeps them whole; only its header may wrap.
    value_like = [all(_is_value(cell) for cell in column[1:]) for column in cells]
    floors = [max([_width(cell) for cell in column[1:]] + [_longest_word(column[0])]) if whole
              else max(_floor(cell) for cell in column) for column, whole in zip(cells, value_like)]
    if sum(floors) > room and not force:
        return None
    widths = list(natural)
    while sum(widths) > room:
        shrinkable = [i for i, (width, floor) in enumerate(zip(widths, floors)) if width > floor]
        if not shrinkable:
            break
        widths[max(shrinkable, key=lambda i: widths[i])] -= 1
    return [(width, whole and width == full) for width, whole, full in zip(widths, value_like, natural)]


def _is_value(text) -> bool:
    """A short cell holding a number, or a single word such as "yes"."""
    plain = text.plain.strip()
    return _width(text) <= _VALUE_WIDTH and (bool(_DIGIT.search(plain)) or " " not in plain)


def _width(text) -> int:
    from rich.cells import cell_len

    return max((cell_len(line) for line in text.plain.split("\n")), default=0)


def _longest_word(text) -> int:
    from rich.cells import cell_len

    return max((cell_len(word) for word in text.plain.split()), default=0)


def _floor(text) -> int:
    """The narrowest a text cell may get: whole if it is a short value, else its longest word with a digit."""
    from rich.cells import cell_len

    if _DIGIT.search(text.plain) and _is_value(text):
        return _width(text)
    return max((cell_len(word) for word in text.plain.split() if _DIGIT.search(word)), default=1)
