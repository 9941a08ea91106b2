"""Installing the auditor in a process, and taking it out again.

``ddplab audit -- COMMAND`` installs it in every Python process of the command (through the
injected sitecustomize, :func:`install_from_env`) for the process's whole life. From code,
:func:`ddplab.audit` installs it for one model and :meth:`Audit.report` (or leaving the ``with``
block) ends it: :func:`uninstall` puts back every patched attribute and removes every hook.
"""

from __future__ import annotations

import os
import sys

from ddplab.auditor import (
    collectives,
    comm_hooks,
    data,
    deepspeed_engine,
    environment,
    evaluation,
    exchange,
    frameworks,
    gathers,
    grad_scaling,
    handwritten,
    hooks,
    losses,
    meshes,
    schedulers,
    state,
)
from ddplab.auditor import findings as fnd
from ddplab.guest.patches import Patches
from ddplab.runtime import timescale

ENV_DIR, ENV_STEPS = "DDPLAB_AUDIT_DIR", "DDPLAB_AUDIT_STEPS"

_PATCHES: Patches | None = None


def install(steps: int = 5, out_dir: str | None = None) -> state.AuditState:
    """Patch this process once; later calls return the same state."""
    global _PATCHES
    audit = state.current()
    if audit is not None:
        return audit
    audit = state.start(steps, out_dir)
    _PATCHES = Patches()
    for module in (hooks, comm_hooks, meshes, collectives, data, evaluation, losses, gathers, grad_scaling, schedulers,
                   frameworks, deepspeed_engine, handwritten):
        module.install(_PATCHES)
    if out_dir:
        _PATCHES.replace(sys, "excepthook", environment.watched_excepthook)
    _PATCHES.at_exit(_at_exit)
    return audit


def uninstall() -> None:
    """Undo every patch and hook and forget the state: the process is as it was before :func:`install`."""
    global _PATCHES
    audit = state.current()
    if audit is not None:
        audit.remove_module_hook()
        audit.remove_mesh_hook()
    if _PATCHES is not None:
        _PATCHES.undo()
        _PATCHES = None
    state.stop()


def patched() -> list[tuple[object, str, object]]:
    """(owner, name, original) of every attribute the installed auditor replaced."""
    return _PATCHES.patched if _PATCHES is not None else []


def install_from_env() -> state.AuditState | None:
    """Install when ``ddplab audit`` set the environment (called from the injected sitecustomize)."""
    if not os.environ.get(ENV_DIR):
        return None
    return install(int(os.environ.get(ENV_STEPS, "5")), os.environ[ENV_DIR])


def write_record() -> None:
    """Write this process's record now, as at its exit (a guest beside the audit that ends the process early)."""
    _at_exit()


def _at_exit() -> None:
    audit = state.current()
    if audit is not None:
        frameworks.at_exit()
        schedulers.at_exit()
        audit.write()


class Audit:
    """An audit started from code (:func:`ddplab.audit`): the process's state, and the way to end it."""

    def __init__(self, audit: state.AuditState):
        self.state = audit

    @property
    def findings(self) -> dict[str, fnd.Finding]:
        """This rank's own findings so far."""
        return self.state.findings

    @property
    def steps(self) -> int:
        """Optimizer steps audited so far."""
        return self.state.steps

    def record(self) -> dict:
        return self.state.record()

    def report(self, timeout: float | None = None) -> fnd.Report:
        """Every rank's record merged, waiting up to ``timeout`` s for the peers' (30 s times DDPLAB_TIME_SCALE by
        default); then the audit ends (uninstall)."""
        try:
            return exchange.gather(self.state, timescale.scaled(30.0) if timeout is None else timeout)
        finally:
            self.close()

    def close(self) -> None:
        """End the audit: every patch undone, every hook removed."""
        if state.current() is self.state:
            uninstall()

    def __enter__(self) -> Audit:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def audit(ddp_model, optimizer=None, sampler=None, steps: int = 5) -> Audit:
    """Audit a DDP model from inside a training script; rank 0 prints a report after ``steps`` optimizer steps.

    ``optimizer`` and ``sampler`` are accepted for symmetry; the auditor finds both by itself.
    """
    audit_state = install(steps=steps)
    hooks.attach(ddp_model)
    if optimizer is not None:
        audit_state.lr = schedulers.configured_lr(optimizer, None)
    return Audit(audit_state)
