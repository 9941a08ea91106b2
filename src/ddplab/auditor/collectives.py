"""The program's own collectives that carry data, watched once for every module that needs to see them.

``torch.distributed``'s data collectives are each replaced once by a wrapper that tells every registered watcher
(:mod:`evaluation`: results combined after an evaluation pass; :mod:`gathers`: features gathered for a loss), then
calls the original. A watcher only reads its arguments; the collective runs as the program called it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch.distributed as dist

from ddplab.guest.patches import Patches

# The collectives that carry data: a barrier or a broadcast of settings combines no results.
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce", "gather",
               "gather_object", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single")

Watcher = Callable[[str, tuple, dict, str], None]
"""(the collective's name, its args, its kwargs, the calling module's __name__) → None."""

_WATCHERS: list[Watcher] = []


def install(patches: Patches) -> None:
    _WATCHERS.clear()
    for name in COLLECTIVES:
        if callable(getattr(dist, name, None)):
            patches.replace(dist, name, functools.partial(_watched_collective, name))


def watch(watcher: Watcher) -> None:
    """Call ``watcher`` before every data collective the program runs (until the auditor is uninstalled)."""
    _WATCHERS.append(watcher)


def _watched_collective(name: str, original):
    @functools.wraps(original)
    def collective(*args, **kwargs):
        if _WATCHERS:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            for watcher in _WATCHERS:
                watcher(name, args, kwargs, caller)
        return original(*args, **kwargs)

    return collective
