"""Injected by ``ddplab audit`` through PYTHONPATH: install the auditor, then chain to any other sitecustomize."""

import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _install_auditor():
    try:
        from ddplab.auditor import install

        install.install_from_env()
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
    _install_auditor()
_chain_next_sitecustomize()
