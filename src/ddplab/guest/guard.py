"""The guard every auditor hook runs under: an internal error disarms the audit, never the user's program."""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable

from ddplab.guest import record


def guarded(state: Callable, where: str):
    """Decorate ``fn(audit, *args)``: skip it once the audit is off, and turn its errors into a disarm.

    ``state()`` returns the process's audit state, or None when the auditor is not installed.
    """
    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            audit = state()
            if audit is None or audit.disabled is not None:
                return None
            try:
                return fn(audit, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the guest never breaks its host
                audit.disarm(f"{where}: {type(exc).__name__}: {exc}")
                return None
        return call
    return wrap


class Slot:
    """The one guest of a product in a process: set once by its ``install_from_env``, read by every hook's guard."""

    def __init__(self):
        self.guest = None

    def current(self):
        return self.guest

    def guarded(self, where: str):
        """:func:`guarded` over this slot's guest."""
        return guarded(self.current, where)


def armed_settings(variable: str) -> tuple[dict, str] | None:
    """(the guest's settings, the folder its records go to) where a product's driver put them in the environment:
    ``variable`` holds the settings as JSON, ``DDPLAB_AUDIT_DIR`` the folder; None where either is missing."""
    settings, out_dir = os.environ.get(variable), os.environ.get(record.ENV_DIR)
    if not settings or not out_dir:
        return None
    return json.loads(settings), out_dir


def leave() -> None:
    """End this process now, exit code 0, its output flushed: a guest that has what it came for, at a point every rank
    reaches together (``os._exit``: no atexit handler, no traceback, no collective left half-done)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)
