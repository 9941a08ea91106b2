"""A torch extension built on first use (DeepSpeed's ops): what to say before it builds, once per build folder.

DeepSpeed compiles an op (its CPU communication op, say) the first time a process initialises it, through torch's
``cpp_extension.load``, which builds in a folder of its own under ``TORCH_EXTENSIONS_DIR`` and holds a ``lock`` file
there while it builds: every other process waits while that file exists. A build killed half-way leaves the file,
and the next run waits on it forever. So the first build is announced with its expected time, and a lock too old to
be a running build's is named. What is said goes to stderr; the build itself is untouched. Torch-free.
"""

from __future__ import annotations

import os
import sys
import time

STALE_AFTER_S = 30 * 60
"""A lock older than this is no build still running: DeepSpeed's ops build in minutes."""
_SAID: set[str] = set()


def say(name: str, folder: str) -> None:
    """Print :func:`notes` on stderr, the first time this process is about to load ``name`` from ``folder``."""
    if folder in _SAID:
        return
    _SAID.add(folder)
    for line in notes(name, folder):
        print(line, file=sys.stderr, flush=True)


def notes(name: str, folder: str, now: float | None = None) -> list[str]:
    """What to say before ``name`` loads from ``folder``: that it builds once (nothing built there yet), and a lock
    too old to be a running build's.

    >>> notes("op", "/nonexistent")[0].startswith("ddplab: DeepSpeed builds its op op once")
    True
    """
    said = []
    if not any(entry.endswith(".so") for entry in _entries(folder)):
        said.append(f"ddplab: DeepSpeed builds its {name} op once (a few minutes on a CPU), in {folder}; later runs "
                    "load it from there")
    lock = os.path.join(folder, "lock")
    try:
        age = (time.time() if now is None else now) - os.path.getmtime(lock)
    except OSError:
        return said
    if age > STALE_AFTER_S:
        said.append(f"ddplab: {lock} is {age / 60:.0f} min old: a build killed half-way leaves it, and torch waits "
                    "while it exists; if no build of this op is running, delete it")
    return said


def _entries(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []
