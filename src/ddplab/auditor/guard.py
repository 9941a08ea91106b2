"""The guard every auditor hook runs under: an internal error disarms the audit, never the user's program."""

from __future__ import annotations

import functools
from collections.abc import Callable


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
