"""Find the DDP mistakes that silently change training: in any launcher (``ddplab audit``) or from code."""

from __future__ import annotations


def audit(ddp_model, optimizer=None, sampler=None, steps: int = 5):
    """Audit a DDP model from inside a training script; rank 0 prints a report after ``steps`` optimizer steps.

    Returns the process's audit state: ``.findings`` (this rank's own), ``.record()``, and
    ``.report(timeout)``, which merges every rank's record (waiting for the peers' at most ``timeout`` s).
    ``optimizer`` and ``sampler`` are accepted for symmetry; the auditor finds both by itself.
    """
    from ddplab.auditor import hooks

    audit_state = hooks.install(steps=steps)
    hooks.attach(ddp_model)
    if optimizer is not None:
        audit_state.lr = optimizer.param_groups[0].get("lr")
    return audit_state
