"""``fsdp``: FSDP2 (``fully_shard``), each rank holding a 1/W shard of every parameter; gradients reduce-scattered.

Each child module with parameters is one FSDP group (its parameters all-gathered for its forward and backward,
its gradients reduce-scattered in one collective), then the root takes what is left. After backward every
parameter's ``.grad`` is a DTensor holding this rank's shard of the averaged gradient; ``full_tensor()``
gathers the whole. How FSDP2 divides the sum: ``docs/concepts/fsdp-reduction.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import typing
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import ClassVar

import torch
import torch.distributed as dist

from ddplab.errors import UsageError
from ddplab.runtime import compat
from ddplab.runtime.config import ReduceDtype
from ddplab.runtime.strategies.base import GradientTap, Strategy
from ddplab.validation import one_of

FULLY_SHARD_TORCH = "2.6"
"""The first torch with ``torch.distributed.fsdp.fully_shard``."""


def require_fully_shard():
    """``torch.distributed.fsdp`` with FSDP2; UsageError naming the torch needed where this torch has none."""
    fsdp = compat.fully_shard_api()
    if fsdp is None:
        raise UsageError(f"the fsdp and hsdp strategies need torch >= {FULLY_SHARD_TORCH} "
                         f"(torch.distributed.fsdp.fully_shard); this is torch {torch.__version__}")
    return fsdp


@dataclasses.dataclass(frozen=True)
class FSDPStrategy(Strategy):
    """Every rank holds a shard of each parameter; FSDP2 reduce-scatters (averages) the gradients over the mesh."""

    name: ClassVar[str] = "fsdp"
    # The user's module is the sharded one: its forward all-gathers the parameters, on every rank.
    collective_forward: ClassVar[bool] = True
    # One mesh dimension: the reduce-scatter is the whole reduction (set_requires_all_reduce has nothing to skip).
    all_reduces: ClassVar[bool] = False
    reduce_dtype: ReduceDtype | None = None
    """The dtype the gradients are reduced in (MixedPrecisionPolicy's reduce_dtype); None: the parameters' own."""

    def __post_init__(self):
        if self.reduce_dtype is not None:
            one_of("reduce_dtype", self.reduce_dtype, typing.get_args(ReduceDtype))

    def check_runnable(self, world_size: int) -> None:
        require_fully_shard()

    def wrap(self, model: torch.nn.Module, ctx, facts=None) -> torch.nn.Module:
        self.check_runnable(ctx.world_size)
        fsdp = require_fully_shard()
        if not any(p.requires_grad for p in model.parameters()):
            raise UsageError(f"{self.name} shards the model's parameters, and this model has none that require "
                             "gradients")
        policy = fsdp.MixedPrecisionPolicy(reduce_dtype=getattr(torch, self.reduce_dtype) if self.reduce_dtype
                                           else None)
        mesh = self.mesh(ctx)
        # Bottom-up, as fully_shard wants: one group per child with parameters, then the root for the rest.
        for child in model.children():
            if any(True for _ in child.parameters()):
                fsdp.fully_shard(child, mesh=mesh, mp_policy=policy)
        return fsdp.fully_shard(model, mesh=mesh, mp_policy=policy)

    def mesh(self, ctx):
        """The device mesh the model is sharded over: one dimension, every rank."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("shard",))

    def owns(self, model) -> bool:
        placements = _placements(model)
        return placements is not None and len(placements) == 1 and placements[0].is_shard()

    def module(self, model: torch.nn.Module) -> torch.nn.Module:
        # fully_shard changes the module in place: the user's module is the wrapped one.
        return model

    def data_parallel_group(self, model) -> dist.ProcessGroup:
        return _mesh(model).get_group()

    def no_sync(self, model) -> AbstractContextManager[None]:
        return _without_sync(model, self.syncs(model))

    def syncs(self, model) -> bool:
        # FSDP2's no_sync is per group: a backward reduces when every group does.
        return all(group.reduce_grads and (group.all_reduce_grads or not self.all_reduces)
                   for group in param_groups(model))

    def divide_factors(self, model) -> set[float]:
        return gradient_divide_factors(model, self.data_parallel_size(model))

    def tap_local_gradients(self, model, params, observe, *, via="auto", comm_hook=None, state=None) -> GradientTap:
        """Post-accumulate-grad hooks on the unsharded parameters: FSDP2 reduce-scatters their ``.grad`` afterwards.

        Autograd accumulates a parameter's local gradient into the unsharded parameter FSDP2 all-gathered, and
        FSDP2's post-backward reads it from there into its reduce-scatter; the hook runs in between. The
        unsharded parameters exist from the first forward on, so the hooks are placed after the first forward
        (a forward hook on ``model``, removed once they are).
        """
        if via == "comm_hook" or comm_hook is not None:
            raise UsageError(f"{self.name} has no DDP communication hook: tap its local gradients with "
                             "{via}='grad_hooks' and no comm_hook")
        fsdp_params = _fsdp_params_of(model, params)
        tap = GradientTap("grad_hooks")
        placer = _PlaceHooks(fsdp_params, observe, tap, self.all_reduces)
        if not placer.place():
            tap.handles.append(model.register_forward_hook(placer))
        return tap

    def reduced_gradient_share(self, model, params) -> Iterator[torch.Tensor]:
        # Each rank's shard of the averaged gradient is its own: disjoint, and together the whole.
        for param in params:
            if param.grad is not None:
                yield param.grad.to_local().reshape(-1)


@contextlib.contextmanager
def _without_sync(model, syncs_before: bool) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(syncs_before)


def gradient_divide_factors(model, data_parallel_size: int) -> set[float]:
    """What FSDP2 divides the sum of the ranks' gradients by, per parameter group of ``model``: the value of
    ``set_gradient_divide_factor``, else the data-parallel size (the default, an average)."""
    # force_sum_reduction_for_comms changes the collective's op, not the division (it moves to a post-divide).
    return {float(group.gradient_divide_factor or data_parallel_size) for group in param_groups(model)}


def param_groups(model) -> list:
    """Every FSDP2 parameter group in ``model`` (its own and its submodules')."""
    return [group for module in model.modules() for group in compat.fsdp_param_groups(module)]


def _sharded_parameter(model):
    """The first DTensor parameter of ``model`` (what fully_shard made of it), or None."""
    fsdp = compat.fully_shard_api()
    if fsdp is None or not isinstance(model, fsdp.FSDPModule):
        return None
    return next((p for p in model.parameters() if hasattr(p, "placements")), None)


def _placements(model):
    param = _sharded_parameter(model)
    return None if param is None else tuple(param.placements)


def _mesh(model):
    return _sharded_parameter(model).device_mesh


def _fsdp_params_of(model, params) -> list:
    """FSDP2's record of each of ``params`` (a sharded parameter of ``model``); UsageError for any other tensor."""
    by_param = {id(fsdp_param.sharded_param): (group, fsdp_param)
                for group in param_groups(model) for fsdp_param in group.fsdp_params}
    found = [by_param.get(id(param)) for param in params]
    if any(item is None for item in found):
        raise UsageError("every tensor whose local gradient is watched must be a parameter that fully_shard "
                         "sharded in this model (its model.parameters())")
    return found


class _PlaceHooks:
    """Hooks on the unsharded parameters, placed as soon as FSDP2 has made them (after an all-gather)."""

    def __init__(self, fsdp_params: list, observe, tap: GradientTap, all_reduces: bool):
        self.fsdp_params, self.observe, self.tap = fsdp_params, observe, tap
        self.all_reduces, self.placed = all_reduces, False

    def place(self) -> bool:
        if not all(hasattr(fsdp_param, "_unsharded_param") for _, fsdp_param in self.fsdp_params):
            return False
        for group, fsdp_param in self.fsdp_params:
            hook = _WhenReducing(group, fsdp_param, self.observe, self.all_reduces)
            self.tap.handles.append(fsdp_param._unsharded_param.register_post_accumulate_grad_hook(hook))
        self.placed = True
        return True

    def __call__(self, module, args, output) -> None:
        if not self.placed and self.place():
            # This forward hook is the first handle: it has done its work.
            self.tap.handles.pop(0).remove()


class _WhenReducing:
    """Passes an unsharded parameter's local gradient on, in backward passes whose post-backward reduces it."""

    __slots__ = ("all_reduces", "fsdp_param", "group", "observe")

    def __init__(self, group, fsdp_param, observe, all_reduces: bool):
        # Weak: the unsharded parameter holds this hook and must not keep FSDP's state alive.
        self.group, self.fsdp_param, self.observe = weakref.ref(group), weakref.ref(fsdp_param), observe
        self.all_reduces = all_reduces

    def __call__(self, unsharded: torch.Tensor) -> None:
        group, fsdp_param = self.group(), self.fsdp_param()
        if group is None or fsdp_param is None or not group.reduce_grads:
            return
        if self.all_reduces and not group.all_reduce_grads:
            # HSDP's set_requires_all_reduce(False): part of the local gradient is already reduce-scattered.
            raise UsageError("the local gradient cannot be seen whole under HSDP's set_requires_all_reduce(False): "
                             "accumulate with set_requires_gradient_sync(False) instead")
        # Under a reduce_dtype, the micro-steps of no_sync wait in FSDP's accumulator, cast to that dtype.
        accumulated = fsdp_param.unsharded_accumulated_grad
        self.observe(unsharded.grad if accumulated is None else accumulated + unsharded.grad)
