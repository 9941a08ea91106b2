"""``hsdp``: FSDP2 on a 2-D mesh (replicate × shard): sharded within each replica, replicated across replicas.

``fully_shard(module, mesh=mesh2d)`` reduce-scatters each gradient over the shard dimension, then all-reduces
the shards over the replicate dimension; both divide, together by replicate × shard. So the data-parallel
degree is the whole mesh, replicate × shard ranks, each training on samples of its own (torchtitan's
``dp_replicate × dp_shard``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import ClassVar

import torch
import torch.distributed as dist

from ddplab.errors import UsageError
from ddplab.parallel_dims import ParallelDims
from ddplab.runtime.strategies.base import flat_shares
from ddplab.runtime.strategies.fsdp import FSDPStrategy, _mesh, _placements
from ddplab.validation import at_least


@dataclasses.dataclass(frozen=True)
class HSDPStrategy(FSDPStrategy):
    """``replicate`` replicas of the model, each sharded over world_size / replicate ranks."""

    name: ClassVar[str] = "hsdp"
    # The shards are all-reduced over the replicas after the reduce-scatter.
    all_reduces: ClassVar[bool] = True
    replicate: int | None = None
    """Replicas (the mesh's first dimension); it must divide the world size, the rest shards each replica."""

    def __post_init__(self):
        super().__post_init__()
        at_least("replicate", self.replicate)

    def dims(self, world_size: int) -> ParallelDims:
        """The world as ``replicate`` replicas of world_size / replicate shards (checked by check_runnable)."""
        return ParallelDims(devices=world_size, replicate_size=self.replicate)

    def check_runnable(self, world_size: int) -> None:
        super().check_runnable(world_size)
        if self.replicate is None or world_size % self.replicate:
            got = "none given" if self.replicate is None else f"got {self.replicate}"
            raise UsageError(f"hsdp needs {{replicate}}, the replicas of its 2-D mesh, to divide the world size "
                             f"{world_size} ({got}): e.g. {{replicate}} 2 on 4 ranks is 2 replicas of 2 shards")

    def mesh(self, ctx):
        """The device mesh: (replicate, shard) = (replicate, world_size / replicate)."""
        from torch.distributed.device_mesh import init_device_mesh

        dims = self.dims(ctx.world_size)
        return init_device_mesh(ctx.device.type, (dims.replicate_size, dims.shard_size),
                                mesh_dim_names=("replicate", "shard"))

    def owns(self, model) -> bool:
        placements = _placements(model)
        return (placements is not None and len(placements) == 2 and placements[0].is_replicate()
                and placements[1].is_shard())

    def data_parallel_group(self, model) -> dist.ProcessGroup:
        mesh = _mesh(model)
        if mesh.size() == dist.get_world_size():
            return dist.group.WORLD
        # A mesh inside a larger one (tensor-parallel ranks beside it): its flattened group, made once and kept.
        return mesh._flatten().get_group()

    def data_parallel_size(self, model) -> int:
        # Replicas × shards: every rank of the mesh trains on samples of its own.
        return _mesh(model).size()

    def data_parallel_rank(self, model) -> int:
        replica, shard = _mesh(model).get_coordinate()
        return replica * _mesh(model).size(1) + shard

    def reduced_gradient_share(self, model, params) -> Iterator[torch.Tensor]:
        # Each shard is held by every replica: each replica takes its own 1/replicate slice of it, so the shares
        # of the whole mesh are disjoint.
        mesh = _mesh(model)
        replica = mesh.get_coordinate()[0]
        locals_ = (param.grad.to_local() if param.grad is not None else None for param in params)
        return flat_shares(locals_, replica, mesh.size(0))
