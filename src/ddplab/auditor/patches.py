"""Every change the auditor makes to torch and the frameworks, recorded so :func:`Patches.undo` restores it.

A patch replaces a class or module attribute and keeps the original; a hook keeps its handle.
Undoing puts every original object back (the same object, not a copy) and removes every hook.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
from typing import Any


class Patches:
    """The record of one installation's patches and hooks."""

    def __init__(self):
        self._originals: list[tuple[Any, str, Any, bool]] = []  # (owner, name, original, was in owner's own dict)
        self._handles: list[Any] = []
        self._exits: list[Callable[[], None]] = []

    def replace(self, owner: Any, name: str, make: Callable[[Any], Any]) -> Any:
        """Set ``owner.name`` to ``make(original)``; returns the original."""
        own = name in vars(owner)
        original = vars(owner)[name] if own else getattr(owner, name)
        self._originals.append((owner, name, original, own))
        setattr(owner, name, make(getattr(owner, name)))
        return original

    def hook(self, handle: Any) -> Any:
        """Keep a hook's removable handle."""
        self._handles.append(handle)
        return handle

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
        self._originals.clear()
        self._handles.clear()
        self._exits.clear()
