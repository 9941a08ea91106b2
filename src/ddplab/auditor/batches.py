"""Training forwards of an audited model: each batch's fingerprint, size and dataset indices, and its micro-step.

Shared by the DDP wrapper's forward (:mod:`hooks`) and FSDP2 roots' (:mod:`meshes`); what a loss computed from
the batch weighs is tied to the model and micro-step recorded here (:mod:`losses`).
"""

from __future__ import annotations

from ddplab.auditor import data, tensors
from ddplab.auditor import findings as fnd
from ddplab.auditor.state import AuditState, WrapperInfo


def record_training_batch(audit: AuditState, info: WrapperInfo, inputs) -> None:
    """A training forward of ``info``'s model: its batch's fingerprint, size and indices."""
    window = audit.data_window
    if len(info.batches) < window:
        fingerprint = tensors.fingerprint(inputs)
        if fingerprint is not None:
            info.batches.append(fingerprint)
            if len(info.batches) == window:
                audit.write()
    fed = data.training_forward(audit, info.key, inputs, window)
    if audit.armed:
        audit.training_info = info
        info.micro_steps += 1
        size = audit.micro_batch = tensors.first_dim(inputs)
        info.forward_batch += size or 0
        info.loader_batch += (size or 0) if fed else 0
        if size is not None:
            _check_batchnorm(audit, info, size)


def _check_batchnorm(audit: AuditState, info: WrapperInfo, per_rank_batch: int) -> None:
    # Per-rank statistics are a choice many correct programs make (and a CNN's spatial positions add to the
    # sample count): an info, never a warning, however small the batch.
    if info.batchnorm_layers and "BATCHNORM_NOT_SYNCED" not in audit.findings:
        detail = f"{info.batchnorm_layers} BatchNorm layers, {per_rank_batch} samples per rank"
        audit.add("BATCHNORM_NOT_SYNCED", detail, severity=fnd.INFO)
