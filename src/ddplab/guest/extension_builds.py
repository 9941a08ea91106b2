"""A torch extension the program builds on first use (DeepSpeed's ops): said once before the build, and a lock a
killed build left behind named, not waited on in silence.

DeepSpeed compiles an op (its CPU communication op, say) the first time a process initialises it, through torch's
``cpp_extension.load``, which builds in a folder of its own under ``TORCH_EXTENSIONS_DIR`` and holds a ``lock`` file
there while it builds: every other process waits while that file exists. A build killed half-way leaves the file,
and the next run waits on it forever. What is said goes to stderr, once per build folder, from the process whose
``RANK`` is 0 (or that has none); the build itself is the program's, untouched. Torch-free but for the wrapped call.
"""

from __future__ import annotations

import functools
import os
import sys
import time

from ddplab.guest import imports
from ddplab.guest.patches import Patches

BUILDER_MODULE = "deepspeed.ops.op_builder.builder"
STALE_AFTER_S = 30 * 60
"""A lock older than this is no build still running: DeepSpeed's ops build in minutes."""
_SAID: set[str] = set()


def watch(patches: Patches) -> None:
    """Wrap DeepSpeed's op loading once the program imports DeepSpeed's op builder (nothing before)."""
    imports.when_imported(patches, BUILDER_MODULE, functools.partial(_patch, patches))


def _patch(patches: Patches, module) -> None:
    try:
        patches.replace(module.OpBuilder, "jit_load", _watched_jit_load)
    except Exception as exc:  # noqa: BLE001 - another DeepSpeed release: its builds go unsaid
        print(f"ddplab: not watching DeepSpeed's op builds ({type(exc).__name__}: {exc})", file=sys.stderr)


def _watched_jit_load(original):
    @functools.wraps(original)
    def jit_load(self, *args, **kwargs):
        try:
            _before_build(self.name)
        except Exception:  # noqa: BLE001, S110 - a note never stands in the program's way
            pass
        return original(self, *args, **kwargs)

    return jit_load


def _before_build(name: str) -> None:
    from torch.utils.cpp_extension import _get_build_directory

    folder = _get_build_directory(name, verbose=False)
    if folder in _SAID or os.environ.get("RANK", "0") != "0":
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
