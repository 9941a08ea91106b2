"""What the program multiplies its gradients by between backward and the optimizer step, measured by its effect.

torchtune's recipe sums its token losses, lets the data-parallel reduction average them, then scales every gradient
by dp / the step's all-reduced token count before it clips and steps; a GradScaler's ``unscale_`` divides by the
loss scale; a loop may divide ``p.grad`` by the accumulation steps. What a loss's elements weigh at backward
(:mod:`ddplab.auditor.weights`) is then not what they weigh in the step: the step's weight is that times this
factor. When a backward of a data-parallel model returns (its reduction done), a few elements of a few of its
gradients are copied; just before the optimizer step they are read again. Where every read element is its copy times
one number, that number is the program's scaling; where they are not (a collective of the program's, a term added to
the gradient), there is no one factor and nothing is folded.

Clipping is told apart by its own rule: the factor torch's clip functions apply across their call (measured the same
way) is taken out, so a clipped step's weights are the loss's, as a step without clipping would give them.

Nothing here changes a gradient: the copies are the auditor's, and only during the audited window.
"""

from __future__ import annotations

import functools

import torch

from ddplab.auditor import state
from ddplab.guest import tensors
from ddplab.guest.patches import Patches

# Gradients copied per model, and elements per gradient: enough to tell one factor from many, cheap at any size.
PROBE_TENSORS, PROBE_ELEMENTS = 4, 64
CLIPS = ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_")
_INSIDE_CLIP = [0]  # clip_grad_norm_ calls clip_grads_with_norm_: the outer call's factor is the clip's


def install(patches: Patches) -> None:
    clip_grad = torch.nn.utils.clip_grad
    for owner in (torch.nn.utils, clip_grad):
        for name in CLIPS:
            if hasattr(owner, name):
                patches.replace(owner, name, _clipping)


def _clipping(original_clip):
    # Not guarded itself: the clip runs whatever the auditor's reading does (each reading is guarded).
    @functools.wraps(original_clip)
    def clip(*args, **kwargs):
        audit = state.current()
        if audit is None or _INSIDE_CLIP[0] or not audit.armed:
            return original_clip(*args, **kwargs)
        info = audit.training_info
        before = _before_clip(info)
        _INSIDE_CLIP[0] += 1
        try:
            out = original_clip(*args, **kwargs)
        finally:
            _INSIDE_CLIP[0] -= 1
        _note_clip(info, before)
        return out

    return clip


@state.guarded("reading the gradients before a clip")
def _before_clip(audit, info):
    return _read(info)


@state.guarded("measuring a clip of the gradients")
def _note_clip(audit, info, before) -> None:
    if info is None or before is None:
        return
    factor = _factor(before, _read(info))
    info.clip_factor = None if factor is None or info.clip_factor is None else info.clip_factor * factor


@state.guarded("copying gradients after backward")
def after_backward(audit) -> None:
    """A backward returned: copy what the newest training forward's model holds in its gradients now."""
    info = audit.training_info
    if info is None or info.engine is not None:
        return
    # Marked with its step: a step whose backward runs inside it (a closure, as Lightning's) finds none of its own.
    info.probe = (info.steps, _copy(info))
    info.clip_factor = 1.0


def measure(audit, info) -> None:
    """Just before ``info``'s optimizer step: ``info.grad_scale`` is the program's factor since the last backward
    (clipping taken out), 1.0 where nothing scaled, None where no one factor was seen."""
    probe, info.probe = info.probe, None
    info.grad_scale = None
    if probe is None or probe[0] != info.steps or probe[1] is None or info.engine is not None or \
            info.clip_factor is None:
        return
    probe = probe[1]
    factor = _factor(probe, _read(info, [param for param, _ in probe]))
    if factor is not None and info.clip_factor:
        info.grad_scale = factor / info.clip_factor


def _copy(info) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """(parameter, a copy of the first elements of its local gradient) for the first few parameters with one."""
    copied = []
    for _, ref in info.param_refs:  # lazily: a model of thousands of parameters stops at its first few
        param = ref()
        grad = _local(param.grad) if param is not None else None
        if grad is not None and grad.numel():
            copied.append((param, grad.reshape(-1)[:PROBE_ELEMENTS].detach().clone()))
            if len(copied) == PROBE_TENSORS:
                break
    return copied or None


def _read(info, params=None) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The same elements as :func:`_copy` reads, now (of ``params``, or of the model's first few)."""
    if info is None:
        return None
    if params is None:
        return _copy(info)
    now = []
    for param in params:
        grad = _local(param.grad)
        if grad is None or not grad.numel():
            return None
        now.append((param, grad.reshape(-1)[:PROBE_ELEMENTS].detach()))
    return now


def _local(grad) -> torch.Tensor | None:
    """A gradient's elements on this rank: a plain tensor, or an FSDP2 shard's local tensor (no collective)."""
    if grad is None:
        return None
    if tensors.is_plain(grad):
        return grad
    local = getattr(grad, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) and tensors.is_plain(local) else None


def _factor(before, after) -> float | None:
    """The one number every element of ``after`` is of its copy in ``before``; None where there is none."""
    if before is None or after is None or len(before) != len(after):
        return None
    ratios = []
    for (param, old), (same, new) in zip(before, after):
        if param is not same or old.shape != new.shape:
            return None
        old, new = old.double(), new.double()
        if bool((new[old == 0] != 0).any()):
            return None  # something was added where nothing was: no scaling
        kept = old != 0
        ratios.append(new[kept] / old[kept])
    ratios = torch.cat(ratios) if ratios else torch.empty(0)
    if ratios.numel() == 0:
        return 1.0
    low, high = float(ratios.min()), float(ratios.max())
    if low <= 0:
        return None  # gradients cleared or turned: no scaling of a step's gradients
    tolerance = max(1e-4, 8 * max(torch.finfo(old.dtype).eps for (_, old) in before))
    return (low + high) / 2 if high - low <= tolerance * max(abs(low), abs(high)) else None
