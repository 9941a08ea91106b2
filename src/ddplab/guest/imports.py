"""Patching a library when the program imports it: a meta path finder that only watches.

The auditor is installed right after torch; a library the program imports later (DeepSpeed) is patched the moment
its module has run, through the import the program makes itself, so a program that never imports it pays nothing.
The finder answers only for the watched names, lets the real finders find them, keeps the real loader (the module
ends with it, as it would unaudited), and leaves ``sys.meta_path`` when the auditor is uninstalled.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from ddplab.guest.patches import Patches


class _Watcher:
    """A meta path finder that runs a callback after a watched module has been executed."""

    def __init__(self):
        self.callbacks: dict[str, Callable] = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.callbacks:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _ThenCall(spec.loader, self.callbacks.pop(fullname))
                return spec
        return None


class _ThenCall:
    """A module's own loader, with a callback once its module has run."""

    def __init__(self, loader, callback: Callable):
        self.loader, self.callback = loader, callback

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__spec__.loader = module.__loader__ = self.loader
        self.loader.exec_module(module)
        self.callback(module)

    def __getattr__(self, name):
        return getattr(self.loader, name)


def when_imported(patches: Patches, name: str, callback: Callable) -> None:
    """``callback(module)`` once module ``name`` is imported (at once if it already is)."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    watcher = next((finder for finder in sys.meta_path if isinstance(finder, _Watcher)), None)
    if watcher is None:
        watcher = _Watcher()
        sys.meta_path.insert(0, watcher)
        patches.on_undo(lambda: sys.meta_path.remove(watcher) if watcher in sys.meta_path else None)
    watcher.callbacks[name] = callback
