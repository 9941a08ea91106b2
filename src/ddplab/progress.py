"""How slow work reports progress: the library calls a callback, the command line draws it.

A run calls ``progress(completed, total, status)`` as it goes and once more with
``completed == total`` when it ends, so a progress bar knows when to close. Inside a rank the
callback is called in that rank's process (a bar started there, after the fork).
"""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    def __call__(self, completed: int, total: int, status: str = "") -> None: ...


def silent(completed: int, total: int, status: str = "") -> None:
    """The progress callback that shows nothing."""
