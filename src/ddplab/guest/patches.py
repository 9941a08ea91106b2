"""Every change the auditor makes to torch and the frameworks, recorded so :func:`Patches.undo` restores it.

A patch replaces a class or module attribute and keeps the original; a hook keeps its handle.
Undoing puts every original object back (the same object, not a copy) and removes every hook.

A replacement's own frame sits between the user's call and torch's code, where it would take the
blame for torch's warnings (``warnings.warn(..., stacklevel=2)`` names its caller's file and line,
which the user's warning filters match on). CPython's warnings machinery steps over frames whose
file name mentions ``importlib`` and ``_bootstrap``, so each replacement's code is given such a name:
a warning raised through it names the user's line, exactly as it would unaudited.
"""

from __future__ import annotations

import atexit
import types
from collections.abc import Callable
from typing import Any

# What a replacement's frames are called in tracebacks; the two words are what the warnings machinery skips.
TRANSPARENT_FILENAME = "<ddplab audit patch: skipped by warnings, like importlib._bootstrap frames>"


def transparent(function: Any) -> Any:
    """``function`` with its code renamed so that warnings raised beneath it name its caller's line."""
    inner = function.__func__ if isinstance(function, (classmethod, staticmethod)) else function
    if isinstance(inner, types.FunctionType):
        inner.__code__ = inner.__code__.replace(co_filename=TRANSPARENT_FILENAME)
    return function


class Patches:
    """The record of one installation's patches and hooks."""

    def __init__(self):
        self._originals: list[tuple[Any, str, Any, bool]] = []  # (owner, name, original, was in owner's own dict)
        self._handles: list[Any] = []
        self._exits: list[Callable[[], None]] = []
        self._undos: list[Callable[[], None]] = []

    def replace(self, owner: Any, name: str, make: Callable[[Any], Any]) -> Any:
        """Set ``owner.name`` to ``make(original)``; returns the original."""
        own = name in vars(owner)
        original = vars(owner)[name] if own else getattr(owner, name)
        self._originals.append((owner, name, original, own))
        setattr(owner, name, transparent(make(getattr(owner, name))))
        return original

    def hook(self, handle: Any) -> Any:
        """Keep a hook's removable handle."""
        self._handles.append(handle)
        return handle

    def on_undo(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` when the patches are undone (a finder to take off ``sys.meta_path``)."""
        self._undos.append(fn)

    def at_exit(self, fn: Callable[[], None]) -> None:
        atexit.register(fn)
        self._exits.append(fn)

    @property
    def patched(self) -> list[tuple[Any, str, Any]]:
        """(owner, name, original) of every replaced attribute, in the order they were replaced."""
        return [(owner, name, original) for owner, name, original, _ in self._originals]

    def undo(self) -> None:
        """Put back every original, remove every hook, unregister every exit function."""
        for owner, name, original, own in reversed(self._originals):
            if own:
                setattr(owner, name, original)
            else:
                # The attribute was inherited: removing ours exposes the base class's again.
                delattr(owner, name)
        for handle in self._handles:
            handle.remove()
        for fn in self._exits:
            atexit.unregister(fn)
        for fn in self._undos:
            fn()
        self._undos.clear()
        self._originals.clear()
        self._handles.clear()
        self._exits.clear()


class Handles:
    """Hook handles that live and go together: one ``remove()`` for all (:meth:`Patches.hook` takes it)."""

    def __init__(self, *handles):
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
