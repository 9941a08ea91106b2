"""torch's private and version-dependent APIs, each behind a fallback, so every torch 2.x ddplab accepts runs.

Each function says what it does when the API is missing; none raises for a missing API.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import signal
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(signum: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``signum`` to this process when its parent dies (Linux); False where it cannot."""
    if sys.platform != "linux":
        return False
    try:
        from torch.multiprocessing import _prctl_pr_set_pdeathsig

        _prctl_pr_set_pdeathsig(signum)
        return True
    except (ImportError, AttributeError, OSError):
        pass
    try:
        # The same prctl through libc when torch no longer ships its helper.
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def default_store():
    """The default process group's key-value store, or None (no group, or no such API in this torch)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 - any failure means "no store": callers fall back to files
        return None


def queue_backward_callback(callback: Callable[[], None]) -> bool:
    """Run ``callback`` when the running backward pass ends; False when this torch cannot say."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(callback)
        return True
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def _init_takes_device_id() -> bool:
    return "device_id" in inspect.signature(dist.init_process_group).parameters


def init_process_group_kwargs(device) -> dict:
    """``device_id`` for init_process_group where this torch takes it (it binds NCCL to the rank's GPU)."""
    return {"device_id": device} if device is not None and _init_takes_device_id() else {}


def collectives_issued() -> int | None:
    """Collectives this process has issued on every process group so far; None where torch cannot say.

    Each group counts its collectives (its sequence number); a process whose count stands still
    across optimizer steps synchronised nothing with its peers in between.
    """
    try:
        from torch.distributed.distributed_c10d import _world

        return sum(group._get_sequence_number_for_group() for group in list(_world.pg_map))
    except Exception:  # noqa: BLE001 - a torch without these internals: no evidence either way
        return None


def ddp_join_hook_class():
    """DDP's join hook class (torch's Join shadows a finished rank's collectives through it), or None."""
    from torch.nn.parallel import distributed

    hook = getattr(distributed, "_DDPJoinHook", None)
    return hook if hook is not None and callable(getattr(hook, "main_hook", None)) else None


def fully_shard_api():
    """``torch.distributed.fsdp`` when it has FSDP2's ``fully_shard`` (torch >= 2.6), else None."""
    try:
        from torch.distributed import fsdp

        return fsdp if hasattr(fsdp, "fully_shard") and hasattr(fsdp, "FSDPModule") else None
    except ImportError:
        return None


def fsdp_param_groups(module) -> list:
    """The FSDP2 parameter groups ``fully_shard(module)`` made (its own, not its submodules'); [] where unreadable.

    Older torches keep one group (``_fsdp_param_group``, None without parameters), newer ones a list.
    """
    try:
        state = module._get_fsdp_state()
    except AttributeError:
        return []
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def world_timeout(device_type: str):
    """The default process group's collective timeout (a timedelta) on ``device_type``'s backend; None where this
    torch does not say."""
    try:
        return dist.group.WORLD._get_backend(torch.device(device_type)).options._timeout
    except (AttributeError, RuntimeError, TypeError):
        return None
