"""Training forwards of an audited model: each batch's fingerprint, size and dataset indices, and its micro-step.

Shared by the DDP wrapper's forward (:mod:`hooks`) and FSDP2 roots' (:mod:`meshes`); what a loss computed from
the batch weighs is tied to the model and micro-step recorded here (:mod:`losses`).
"""

from __future__ import annotations

import functools

from ddplab.auditor import data, state
from ddplab.auditor.catalogue import INFO
from ddplab.auditor.state import AuditState, WrapperInfo
from ddplab.guest import tensors


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


def after_training_forward(audit: AuditState, info: WrapperInfo, output) -> None:
    """The first training forward after an optimizer step: does its backward start from that step's gradients?

    Judged when backward reaches the model's output, not at the forward (``zero_grad()`` between the forward and
    ``loss.backward()``, the tutorials' order, is as good as before it); the finding then needs the next step to
    come with no ``zero_grad`` in between (:func:`check_cleared`): a GAN's discriminator keeps its gradients
    through the generator's backward and clears them before its own next step.
    """
    if not (audit.armed and info.micro_steps == 1 and info.steps >= 1) or "GRADIENTS_NOT_CLEARED" in audit.findings:
        return
    for tensor in tensors.iter_tensors(output):
        if tensor.grad_fn is not None:
            # A hook on the graph's node, not on the user's tensor; it returns None: the gradient is unchanged.
            tensor.grad_fn.register_prehook(functools.partial(_backward_started, info, info.steps))
            return


def _backward_started(info: WrapperInfo, step: int, grad_outputs):
    _note_carried(info, step)
    return None


@state.guarded("checking that gradients were cleared")
def _note_carried(audit: AuditState, info: WrapperInfo, step: int) -> None:
    if info.steps != step or info.micro_steps > 1 or info.carried is not None:
        return  # this backward belongs to a later micro-batch, or was judged already
    kept = [name for name, param in info.params() if param.grad is not None and bool(_local(param.grad).any())]
    info.carried = (kept[0], len(kept)) if kept else None


def check_cleared(audit: AuditState, info: WrapperInfo) -> None:
    """At an optimizer step: gradients carried from the last step into this one's backward, and no zero_grad since."""
    carried, info.carried = info.carried, None
    if carried is None or audit.zero_grad_calls != info.zero_grad_calls or "GRADIENTS_NOT_CLEARED" in audit.findings:
        return
    first, count = carried
    audit.add("GRADIENTS_NOT_CLEARED",
              f"the first backward after optimizer step {info.steps - 1} started with the gradients of {count} of "
              f"{len(info.params())} parameters still nonzero (first: '{first}'), and no zero_grad ran before "
              f"optimizer step {info.steps}")


def _local(tensor):
    # A DTensor's shard on this rank: reading it runs no collective.
    return getattr(tensor, "_local_tensor", tensor)


def _check_batchnorm(audit: AuditState, info: WrapperInfo, per_rank_batch: int) -> None:
    # Per-rank statistics are a choice many correct programs make (and a CNN's spatial positions add to the
    # sample count): an info, never a warning, however small the batch.
    if info.batchnorm_layers and "BATCHNORM_NOT_SYNCED" not in audit.findings:
        detail = f"{info.batchnorm_layers} BatchNorm layers, {per_rank_batch} samples per rank"
        audit.add("BATCHNORM_NOT_SYNCED", detail, severity=INFO)
