"""Device meshes: which ranks add samples to the global batch, and how each strategy accumulates (no torch).

The sizes are :class:`~ddplab.parallel_dims.ParallelDims`' (the audit's and the runtime's too); the functions here
are its arithmetic by keyword, as the plan's formulas write it.

A world of ``devices × nodes`` ranks is a mesh of data-parallel × tensor × pipeline × context
parallel ranks. Only the data-parallel ranks load distinct samples; the ranks of one tensor,
pipeline or context-parallel group work on the same samples (a slice of each layer, a stage, a
slice of each sequence). torchtitan's ``parallel_dims.py`` says the same: its batch mesh is
``dp_replicate × dp_shard``, and ``non_data_parallel_size`` is ``cp × tp × pp``.

>>> data_parallel_size(world_size=16, tensor_parallel_size=2)
8
>>> global_batch_size(per_device_batch_size=8, data_parallel_size=8, accumulation_steps=1)
64
>>> tokens_per_step(global_batch_size=64, seq_len=4096)
262144
>>> shard_size(data_parallel_size=8, replicate_size=2)
4
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

from ddplab.parallel_dims import ParallelDims

Strategy = Literal["ddp", "fsdp", "hsdp", "deepspeed-zero0", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"]
STRATEGIES: tuple[Strategy, ...] = get_args(Strategy)
__all__ = ["NOTES", "STRATEGIES", "ParallelDims", "Strategy", "StrategyNotes", "data_parallel_size", "divides",
           "global_batch_size", "model_parallel_size", "shard_size", "tokens_per_step"]


def model_parallel_size(*, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                        context_parallel_size: int = 1) -> int:
    """Ranks that share one data-parallel rank's samples: tp × pp × cp (torchtitan's ``non_data_parallel_size``).

    >>> model_parallel_size(tensor_parallel_size=2, pipeline_parallel_size=4, context_parallel_size=2)
    16
    """
    return ParallelDims(devices=1, tensor_parallel_size=tensor_parallel_size,
                        pipeline_parallel_size=pipeline_parallel_size,
                        context_parallel_size=context_parallel_size).model_parallel_size


def divides(*, world_size: int, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
            context_parallel_size: int = 1) -> bool:
    """Whether tp × pp × cp divides the world, so that the rest is a whole data-parallel degree.

    >>> divides(world_size=16, tensor_parallel_size=2), divides(world_size=16, tensor_parallel_size=3)
    (True, False)
    """
    return ParallelDims(devices=world_size, tensor_parallel_size=tensor_parallel_size,
                        pipeline_parallel_size=pipeline_parallel_size,
                        context_parallel_size=context_parallel_size).divides


def data_parallel_size(*, world_size: int, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                       context_parallel_size: int = 1) -> int:
    """The data-parallel degree: world size ÷ (tp × pp × cp), the ranks that load distinct samples.

    Raises ValueError when tp × pp × cp does not divide the world (the configs check first, naming their fields).

    >>> data_parallel_size(world_size=16, tensor_parallel_size=2, context_parallel_size=2)
    4
    >>> data_parallel_size(world_size=8)
    8
    """
    return ParallelDims(devices=world_size, tensor_parallel_size=tensor_parallel_size,
                        pipeline_parallel_size=pipeline_parallel_size,
                        context_parallel_size=context_parallel_size).data_parallel_size


def global_batch_size(*, per_device_batch_size: int, data_parallel_size: int, accumulation_steps: int = 1) -> int:
    """Samples behind one optimizer step under a mesh: per-device batch × data-parallel degree × accumulation.

    The per-device batch is a data-parallel rank's (torchtitan's ``local_batch_size``); tensor, pipeline
    and context-parallel ranks add none.

    >>> global_batch_size(per_device_batch_size=8, data_parallel_size=8, accumulation_steps=4)
    256
    """
    return per_device_batch_size * data_parallel_size * accumulation_steps


def tokens_per_step(*, global_batch_size: int, seq_len: int) -> int:
    """Tokens behind one optimizer step: global batch × sequence length (context parallelism splits, not adds).

    >>> tokens_per_step(global_batch_size=8, seq_len=8192)
    65536
    """
    return global_batch_size * seq_len


def shard_size(*, data_parallel_size: int, replicate_size: int) -> int:
    """HSDP's shard degree: the data-parallel degree ÷ the replicate degree.

    Raises ValueError when the replicate degree does not divide the data-parallel degree.

    >>> shard_size(data_parallel_size=8, replicate_size=8), shard_size(data_parallel_size=8, replicate_size=1)
    (1, 8)
    """
    return ParallelDims(devices=data_parallel_size, replicate_size=replicate_size).shard_size


@dataclasses.dataclass(frozen=True, kw_only=True)
class StrategyNotes:
    """What a plan says about one parallelism strategy: none of it changes the arithmetic."""

    name: Strategy
    label: str
    """How the prose names it (``DDP``, ``FSDP2``)."""
    over_data_parallel: str
    """What it does over the data-parallel ranks, after "; " in the data-parallel degree's reason."""
    accumulation: str | None
    """How to accumulate without reducing on the micro-steps, after "; " in the accumulation reason (None: as DDP,
    with ``no_sync()``, said nowhere)."""
    shards: bool
    """Whether it shards the parameters over data-parallel ranks (and with them gradients and optimizer state)."""
    takes_replicate: bool
    """Whether it has a replicate degree (``data_parallel_replicate_size``)."""

    def split(self, data_parallel_size: int, replicate_size: int | None) -> tuple[int | None, int | None]:
        """(replicate degree, shard degree) over the data-parallel ranks; (None, None) when HSDP's split is not given.

        As torchtitan's ``dp_replicate × dp_shard``: DDP replicates over every data-parallel rank, FSDP shards over
        every one.
        """
        if self.takes_replicate:
            if replicate_size is None:
                return None, None
            return replicate_size, shard_size(data_parallel_size=data_parallel_size, replicate_size=replicate_size)
        return (1, data_parallel_size) if self.shards else (data_parallel_size, 1)


def _without_no_sync(strategy: str, skipped: str) -> str:
    """FSDP2's accumulation: it has no ``no_sync()``, and its switch keeps the unsharded gradients."""
    return (f"under {strategy} there is no no_sync(): call model.set_requires_gradient_sync(False) on the micro-steps "
            f"before the last (it skips their {skipped} and keeps unsharded gradients in memory until the last "
            "micro-step reduces them) and True on the last")


ZERO_SHARDS = ("nothing: it replicates the model and optimizer state over them and all-reduces gradients among "
               "them", "optimizer state over them and all-reduces gradients among them",
               "optimizer state and gradients over them and reduce-scatters gradients among them",
               "parameters, gradients and optimizer state over them and reduce-scatters gradients among them")
"""What each ZeRO stage shards over the data-parallel ranks."""


def _zero(stage: int) -> StrategyNotes:
    """DeepSpeed's engine at ZeRO stage ``stage``: its own accumulation, and what the stage shards."""
    return StrategyNotes(
        name=f"deepspeed-zero{stage}", label=f"DeepSpeed ZeRO-{stage}", shards=stage == 3, takes_replicate=False,
        over_data_parallel=f"DeepSpeed ZeRO-{stage} shards {ZERO_SHARDS[stage]}",
        accumulation="DeepSpeed's engine accumulates itself: call engine.backward(loss) and engine.step() on every "
                     "micro-batch; it divides the loss by gradient_accumulation_steps and steps at each boundary, so "
                     "no no_sync() and no division of your own")


NOTES: dict[Strategy, StrategyNotes] = {notes.name: notes for notes in (
    StrategyNotes(name="ddp", label="DDP", shards=False, takes_replicate=False, accumulation=None,
                  over_data_parallel="DDP replicates the model over them and all-reduces gradients among them"),
    StrategyNotes(name="fsdp", label="FSDP2", shards=True, takes_replicate=False,
                  over_data_parallel="fsdp (FSDP2's fully_shard) shards parameters, gradients and optimizer state "
                                     "over them and reduce-scatters gradients among them",
                  accumulation=_without_no_sync("fsdp", "reduce-scatter")),
    StrategyNotes(name="hsdp", label="HSDP", shards=True, takes_replicate=True,
                  over_data_parallel="hsdp (FSDP2 on a 2-D mesh) shards within each shard group, reduce-scatters "
                                     "there and all-reduces across the replicas",
                  accumulation=_without_no_sync("hsdp", "reduce-scatter and the all-reduce")
                  + "; or set_requires_all_reduce(False) defers only the all-reduce across the replicas: each "
                    "micro-step still reduce-scatters within its shard group, so gradients stay sharded"),
    *(_zero(stage) for stage in range(4)),
)}
"""Every strategy's notes, by name: the plan asks these and never compares a strategy's name."""
