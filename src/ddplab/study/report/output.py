"""Where a study's results go: the output directory checked before anything trains, and matplotlib asked
for before a study that plots starts.
"""

from __future__ import annotations

import os
import tempfile

from ddplab.errors import UsageError, literal


def check_out(directory: str) -> None:
    """Make sure the output directory exists and takes files, before anything trains."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise UsageError(f"{{out}} {literal(directory)} is a file: give a directory for the study's cache and results")
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise UsageError(f"{{out}} {literal(directory)} is not writable ({literal(exc.strerror or exc)}): choose "
                         "another {out}") from None


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("ddplab study's plots need matplotlib: pip install 'ddplab[study]' (or {plots=False})") \
            from None
