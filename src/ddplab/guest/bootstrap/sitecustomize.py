"""Injected by ``ddplab audit`` through PYTHONPATH: arm the auditor, then chain to any other sitecustomize.

``DDPLAB_GUEST`` names another guest module to arm instead (``ddplab noise -- COMMAND`` arms its own); any
such module has an ``install_from_env()``.

The auditor loads when the program itself imports torch, right after torch finishes importing, so a
process that never imports torch is left exactly as it was (no torch loaded, no start-up cost), and
whatever a program does before its ``import torch`` (OMP_NUM_THREADS, its own warning filters) acts
as it would unaudited.
"""

import importlib
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _install_auditor():
    try:
        guest = importlib.import_module(os.environ.get("DDPLAB_GUEST") or "ddplab.auditor.install")
        guest.install_from_env()
        _mark("loaded", "")
    except Exception as exc:  # never break the user's program because auditing failed
        print(f"ddplab audit: auditing disabled in this process: {exc!r}", file=sys.stderr)
        _mark("failed", repr(exc))


def _mark(kind, text):
    # Tells the parent the auditor reached this process (or why not), even if no DDP model follows.
    try:
        with open(os.path.join(os.environ["DDPLAB_AUDIT_DIR"], f"{kind}-{os.getpid()}.txt"), "w") as fh:
            fh.write(text)
    except OSError:
        pass


class _AfterTorch:
    """A meta path finder that only watches: when ``torch`` is imported, install the auditor after it loads."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        # It stays on the path until torch really runs: importlib.util.find_spec("torch") only asks where torch is,
        # as transformers and datasets do when they are imported before torch.
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _InstallAfter(spec.loader)
                return spec
        return None  # the import goes on as if this finder were not there


class _InstallAfter:
    """torch's own loader, with the auditor installed once torch's module has run."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _AfterTorch)]
        # The module keeps its real loader, as it would unaudited.
        module.__spec__.loader = module.__loader__ = self.loader
        self.loader.exec_module(module)
        _install_auditor()

    def __getattr__(self, name):
        return getattr(self.loader, name)


def _arm():
    _mark("site", "")
    if "torch" in sys.modules:
        _install_auditor()
    else:
        sys.meta_path.insert(0, _AfterTorch())


def _chain_next_sitecustomize():
    for entry in sys.path:
        if os.path.abspath(entry or os.curdir) == _HERE:
            continue
        candidate = os.path.join(entry or os.curdir, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_ddplab_chained_sitecustomize", candidate)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


if os.environ.get("DDPLAB_AUDIT_DIR"):
    _arm()
_chain_next_sitecustomize()
