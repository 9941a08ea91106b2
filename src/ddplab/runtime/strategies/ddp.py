"""``ddp``: DistributedDataParallel, one full replica per rank, gradients all-reduced (averaged) in buckets."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddplab.errors import UsageError
from ddplab.runtime.strategies.base import GradientTap, LocalGradientPath, Strategy, flat_shares


@dataclasses.dataclass(frozen=True)
class DDPStrategy(Strategy):
    """Every rank holds the whole model; DDP averages the gradients over its process group during backward."""

    name: ClassVar[str] = "ddp"

    def wrap(self, model: torch.nn.Module, ctx, facts=None) -> DistributedDataParallel:
        # Without find_unused_parameters DDP waits for a gradient that never comes and fails at the next step;
        # with it when every parameter is used, each rank prints a warning and pays a graph traversal per step.
        find_unused = facts is not None and facts.find_unused_parameters
        return DistributedDataParallel(model, device_ids=ctx.device_ids, find_unused_parameters=find_unused)

    def owns(self, model) -> bool:
        return isinstance(model, DistributedDataParallel)

    def module(self, model: DistributedDataParallel) -> torch.nn.Module:
        return model.module

    def data_parallel_group(self, model: DistributedDataParallel) -> dist.ProcessGroup:
        return model.process_group

    def no_sync(self, model: DistributedDataParallel) -> AbstractContextManager[None]:
        return model.no_sync()

    def syncs(self, model: DistributedDataParallel) -> bool:
        return model.require_backward_grad_sync

    def syncs_buffers(self, model: DistributedDataParallel) -> bool:
        # Read before DDP's own pre-forward: whether it is about to broadcast rank 0's buffers.
        return model.require_backward_grad_sync and model.will_sync_module_buffers()

    def tap_local_gradients(self, model: DistributedDataParallel, params, observe, *, via="auto", comm_hook=None,
                            state=None) -> GradientTap:
        """Two paths: post-accumulate-grad hooks on ``.grad`` ("grad_hooks"), or DDP's one comm-hook slot.

        On "grad_hooks" a parameter's ``.grad`` still holds the local gradient when its hook runs (DDP copies it
        into its bucket and writes the averaged result back only when backward ends); DDP's built-in C++
        reduction stays untouched and its comm-hook slot free. "comm_hook" sees each bucket before it is reduced,
        then runs the user's hook, or reproduces the reducer's arithmetic bit for bit; it is the only path with a
        user hook or ``gradient_as_bucket_view=True``, where ``.grad`` is the bucket itself.
        """
        path = _path(via, comm_hook, model)
        if path == "comm_hook":
            model.register_comm_hook(_ObservedReduction(observe, comm_hook, state, model.process_group),
                                     _ObservedReduction.hook)
            return GradientTap(path)
        synced = _WhenSyncing(model, observe)
        return GradientTap(path, [p.register_post_accumulate_grad_hook(synced) for p in params])

    def reduced_gradient_share(self, model: DistributedDataParallel, params) -> Iterator[torch.Tensor]:
        # Every rank holds the whole averaged gradient: each takes its 1/W slice of every tensor.
        return flat_shares((p.grad for p in params), self.data_parallel_rank(model), self.data_parallel_size(model))


def _path(via: str, comm_hook, model: DistributedDataParallel) -> LocalGradientPath:
    bucket_view = getattr(model, "gradient_as_bucket_view", False)
    if via == "grad_hooks" and (comm_hook is not None or bucket_view):
        raise UsageError("{via}='grad_hooks' cannot see the local gradient with a user comm hook or "
                         "gradient_as_bucket_view=True; use via='comm_hook'")
    if via != "auto":
        return via
    return "comm_hook" if comm_hook is not None or bucket_view else "grad_hooks"


class _WhenSyncing:
    """A post-accumulate-grad hook passing ``.grad`` on in backward passes that reduce; holds the model weakly."""

    __slots__ = ("model", "observe")

    def __init__(self, model, observe):
        # Weak: the parameters hold their hooks, and must not keep the wrapper (and its process group) alive.
        self.model, self.observe = weakref.ref(model), observe

    def __call__(self, param) -> None:
        model = self.model()
        # Under no_sync the grad only accumulates; the synchronising micro-step holds all A·b samples.
        if model is not None and model.require_backward_grad_sync:
            self.observe(param.grad)


class _ObservedReduction:
    """DDP's comm-hook state: each bucket shown to ``observe``, then reduced by the user's hook or as DDP would."""

    def __init__(self, observe, comm_hook, state, group):
        self.observe, self.comm_hook, self.state, self.group = observe, comm_hook, state, group
        self.world_size = dist.get_world_size(group)

    @staticmethod
    def hook(self: _ObservedReduction, bucket):
        buffer = bucket.buffer()
        # The local gradient, before the in-place reduction overwrites it.
        self.observe(buffer)
        if self.comm_hook is not None:
            return self.comm_hook(self.state, bucket)
        # DDP's reducer multiplies by 1/W, then sums: the same order is bit-identical.
        buffer.mul_(1.0 / self.world_size)
        return dist.all_reduce(buffer, group=self.group, async_op=True).get_future().then(_first_tensor)


def _first_tensor(future):
    # DDP wants a future of the bucket tensor; the all-reduce's future holds a one-tensor list.
    return future.value()[0]
