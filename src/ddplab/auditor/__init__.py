"""Find the DDP mistakes that silently change training: in any launcher (``ddplab audit``) or from code.

state (side tables, the guard) · patches (every change, undoable) · hooks (DDP, modules, optimizers) ·
meshes (FSDP2 and device meshes) · losses · data (samplers) · schedulers · frameworks ·
exchange (records between ranks, no collective) · findings (the catalogue, merging, pure) · tensors (digests) ·
install · runner (``ddplab audit``) · bootstrap (the injected sitecustomize).
"""

from __future__ import annotations


def audit(ddp_model, optimizer=None, sampler=None, steps: int = 5):
    """See :func:`ddplab.auditor.install.audit`."""
    from ddplab.auditor.install import audit as _audit

    return _audit(ddp_model, optimizer=optimizer, sampler=sampler, steps=steps)
