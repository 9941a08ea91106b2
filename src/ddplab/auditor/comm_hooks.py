"""DDP communication hooks: what the program's own hook divides the ranks' summed gradients by, measured.

DDP's built-in reduction averages; a hook registered with ``register_comm_hook`` replaces it. torch's own hooks
(``torch.distributed.algorithms.ddp_comm_hooks``: allreduce, fp16 and bf16 compression, PowerSGD) average too. Any
other hook may sum, average or scale, so its divisor D is measured, not guessed: during the audited window the hook
is called through a wrapper that reads one linear functional f (a fixed weighted sum of a bucket's elements) of each
bucket before the hook and of its result after. The buckets are laid out alike on every rank, so
Σ_r f(local_r) = D · f(reduced); :func:`ddplab.runtime.reduction.measured_divisor` solves it once every rank's
record is in. The wrapper adds no collective, passes the hook's own future on (a callback that returns its value
unchanged), and outside the window calls the hook and nothing else.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.nn.parallel import DistributedDataParallel

from ddplab.auditor import state
from ddplab.auditor.state import AuditState, WrapperInfo
from ddplab.guest import tensors
from ddplab.guest.patches import Patches
from ddplab.runtime.reduction import Reduction

TORCH_HOOKS = "torch.distributed.algorithms.ddp_comm_hooks"


def install(patches: Patches) -> None:
    patches.replace(DistributedDataParallel, "register_comm_hook", _watched_register)


def _watched_register(original_register):
    @functools.wraps(original_register)
    def register_comm_hook(self, state, hook):
        return original_register(self, state, _as_registered(self, hook))

    return register_comm_hook


def _as_registered(ddp, hook):
    """The hook DDP is given: the program's own, wrapped to be measured where its divisor is not known."""
    info = _note_hook(ddp, hook)
    return hook if info is None else _measuring(hook, weakref.ref(info))


@state.guarded("reading a DDP communication hook")
def _note_hook(audit: AuditState, ddp, hook) -> WrapperInfo | None:
    info = audit.wrappers.get(ddp)
    if info is None:
        return None
    name = getattr(hook, "__qualname__", None) or type(hook).__name__
    size = len(info.group)
    if (getattr(hook, "__module__", None) or "").startswith(TORCH_HOOKS):
        info.reduction = Reduction("ddp", size, float(size), f"torch's {name} comm hook")
        return None
    info.reduction = Reduction("ddp", size, None, f"the comm hook {name}, measured")
    return info


def _measuring(hook, info_ref: weakref.ref):
    # functools.wraps keeps the hook's name and signature, which DDP reads (its 'bucket' parameter, its __qualname__).
    @functools.wraps(hook)
    def measured(state, bucket):
        local = _local_sum(info_ref, bucket)
        future = hook(state, bucket)
        if local is None:
            return future
        return future.then(functools.partial(_reduced, info_ref, local))

    return measured


@state.guarded("measuring a DDP communication hook")
def _local_sum(audit: AuditState, info_ref: weakref.ref, bucket) -> float | None:
    info = info_ref()
    if info is None or not audit.armed:
        return None
    # Read before the hook runs: most hooks reduce the bucket in place.
    return tensors.functional(bucket.buffer())


def _reduced(info_ref: weakref.ref, local: float, future):
    value = future.value()
    _note_reduced(info_ref, local, value)
    return value


@state.guarded("measuring a DDP communication hook")
def _note_reduced(audit: AuditState, info_ref: weakref.ref, local: float, value) -> None:
    info = info_ref()
    reduced = value[0] if isinstance(value, (list, tuple)) and value else value
    if info is None or not isinstance(reduced, torch.Tensor):
        return
    sums = info.comm_sums or [0.0, 0.0]
    info.comm_sums = [sums[0] + local, sums[1] + tensors.functional(reduced)]
