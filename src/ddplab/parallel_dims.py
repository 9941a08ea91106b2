"""One value for how a world of ranks divides (torchtitan's ``ParallelDims``): validated once, every degree derived.

A world of ``devices × nodes`` ranks is a mesh of pp × dp_replicate × dp_shard × cp × tp ranks. Only the
data-parallel ranks (replicate × shard) load distinct samples; the ranks of one tensor, pipeline or
context-parallel group work on the same samples. The plan reads its meshes here, the audit reads a program's
``DeviceMesh`` into one (:meth:`ParallelDims.from_mesh`), and the runtime's HSDP builds its mesh from one, so the
three cannot disagree on the data-parallel degree. No torch.

>>> dims = ParallelDims(devices=8, nodes=2, tensor_parallel_size=2, replicate_size=2)
>>> dims.world_size, dims.data_parallel_size, dims.shard_size, dims.mesh_shape()
(16, 8, 4, {'dp_replicate': 2, 'dp_shard': 4, 'tp': 2})
"""

from __future__ import annotations

import dataclasses
import math

from ddplab.errors import UsageError
from ddplab.text import count

ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The mesh's dimensions, outermost first (torchtitan's order)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """A world of devices × nodes ranks as data-parallel × tp × pp × cp ranks; HSDP splits the data-parallel ranks
    into ``replicate_size`` replicas of ``shard_size`` shards."""

    devices: int
    """Ranks per node (the whole world where nodes are not told apart)."""
    nodes: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    replicate_size: int | None = None
    """HSDP's replicas of the data-parallel ranks (None: not split, as DDP and FSDP)."""

    @classmethod
    def from_mesh(cls, sizes: dict[str, int], *, data: list[str], context: list[str] = (), pipeline: list[str] = (),
                  replicated: bool = False) -> ParallelDims:
        """The dims of a program's mesh (dimension name → size): ``data`` the dimensions its gradients are
        averaged over (the first the replicas where ``replicated``), ``context`` and ``pipeline`` by their roles,
        any other dimension tensor-parallel.

        >>> ParallelDims.from_mesh({"dp": 2, "tp": 2}, data=["dp"]).data_parallel_size
        2
        >>> hsdp = ParallelDims.from_mesh({"replicate": 2, "shard": 2, "cp": 2}, data=["replicate", "shard"],
        ...                               context=["cp"], replicated=True)
        >>> hsdp.mesh_shape()
        {'dp_replicate': 2, 'dp_shard': 2, 'cp': 2}
        """
        def size(names) -> int:
            return math.prod(sizes[name] for name in names)

        model = [name for name in sizes if name not in (*data, *context, *pipeline)]
        return cls(devices=math.prod(sizes.values()), tensor_parallel_size=size(model),
                   pipeline_parallel_size=size(pipeline), context_parallel_size=size(context),
                   replicate_size=sizes[data[0]] if replicated and len(data) > 1 else None)

    @property
    def world_size(self) -> int:
        return self.devices * self.nodes

    @property
    def model_parallel_size(self) -> int:
        """tp × pp × cp: ranks that share one data-parallel rank's samples (torchtitan's ``non_data_parallel_size``).

        >>> ParallelDims(devices=16, tensor_parallel_size=2, pipeline_parallel_size=4).model_parallel_size
        8
        """
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.context_parallel_size

    @property
    def divides(self) -> bool:
        """Whether tp × pp × cp divides the world, so that the rest is a whole data-parallel degree."""
        return self.world_size % self.model_parallel_size == 0

    @property
    def data_parallel_size(self) -> int:
        """The ranks that load distinct samples: world size ÷ (tp × pp × cp).

        Raises ValueError when tp × pp × cp does not divide the world (:meth:`check` first names the fields).
        """
        if not self.divides:
            raise ValueError(f"tp × pp × cp = {self.model_parallel_size} does not divide the world size "
                             f"{self.world_size}")
        return self.world_size // self.model_parallel_size

    @property
    def shard_size(self) -> int:
        """HSDP's shard degree, the data-parallel degree ÷ the replicas (all of it where not split).

        Raises ValueError when the replicas do not divide the data-parallel degree.
        """
        replicate = self.replicate_size or 1
        if self.data_parallel_size % replicate:
            raise ValueError(f"replicate {replicate} does not divide the data-parallel degree "
                             f"{self.data_parallel_size}")
        return self.data_parallel_size // replicate

    def mesh_shape(self) -> dict[str, int]:
        """The mesh's dimensions of more than one rank, outermost first, by torchtitan's names."""
        sizes = {"pp": self.pipeline_parallel_size, "dp_replicate": self.replicate_size or 1,
                 "dp_shard": self.shard_size, "cp": self.context_parallel_size, "tp": self.tensor_parallel_size}
        return {name: sizes[name] for name in ORDER if sizes[name] > 1}

    def check(self, prefix: str) -> None:
        """tp × pp × cp must divide the world, in a sentence that names the ``prefix`` config's fields."""
        if self.divides:
            return
        world = self.world_size
        raise UsageError(f"{count(world, 'rank')} ({count(self.nodes, 'node')} × {count(self.devices, 'device')}) "
                         f"{'does' if world == 1 else 'do'} not split into tp {self.tensor_parallel_size} × pp "
                         f"{self.pipeline_parallel_size} × cp {self.context_parallel_size}: choose "
                         f"{{{prefix}.tensor_parallel_size}}, {{{prefix}.pipeline_parallel_size}} and "
                         f"{{{prefix}.context_parallel_size}} whose product divides {world}")

    @property
    def rank(self) -> str:
        """What the prose calls one rank that loads its own samples."""
        return "rank" if self.model_parallel_size == 1 else "data-parallel rank"

    @property
    def ranks(self) -> str:
        """The ranks that split the global batch, counted ("8 ranks", "8 data-parallel ranks")."""
        return count(self.data_parallel_size, self.rank)

    @property
    def ranks_noun(self) -> str:
        return "world size" if self.model_parallel_size == 1 else "data-parallel degree"

    @property
    def degrees(self) -> str:
        """The model-parallel degrees above 1 ("tp 8 × pp 16"; "tp 1" where there are none).

        >>> ParallelDims(devices=8, tensor_parallel_size=8, pipeline_parallel_size=16).degrees
        'tp 8 × pp 16'
        """
        parts = [f"{name} {size}" for name, size in (("tp", self.tensor_parallel_size),
                                                     ("pp", self.pipeline_parallel_size),
                                                     ("cp", self.context_parallel_size)) if size > 1]
        return " × ".join(parts) or "tp 1"

    @property
    def division(self) -> str:
        """"16 ranks ÷ tp 2", "16 ranks ÷ (tp 2 × cp 2)": how the world divides into data-parallel ranks.

        >>> ParallelDims(devices=8, nodes=2, tensor_parallel_size=2).division
        '16 ranks ÷ tp 2'
        """
        shared = self.degrees if "×" not in self.degrees else f"({self.degrees})"
        return f"{count(self.world_size, 'rank')} ÷ {shared}"
