"""What every command that trains a spec on DDP ranks takes (torch-free: the command line reads its defaults)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, get_args

from ddplab.parallel_dims import ParallelDims
from ddplab.validation import at_least, one_of

DEFAULT_WORLD_SIZE = 2
"""Ranks a command starts when none are asked for (under torchrun: torchrun's WORLD_SIZE)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpecRunConfig:
    """A spec trained on W DDP ranks of b samples each (``ddplab check``, ``ddplab noise``)."""

    spec_path: str
    """The training spec file (model(), dataset(), loss(), optionally optimizer() and step())."""
    per_device_batch_size: int
    """Per-device (per-rank) batch."""
    world_size: int | None = None
    """DDP ranks (default 2; under torchrun its WORLD_SIZE)."""
    steps: int
    """Optimizer steps."""
    seed: int = 0
    """Model init and data order seed."""

    def __post_init__(self):
        for field in ("world_size", "per_device_batch_size", "steps"):
            at_least(field, getattr(self, field))



StrategyName = Literal["ddp", "fsdp", "hsdp", "deepspeed"]
"""The parallelism strategies (``ddplab.runtime.strategies``, registered by these names)."""
DEFAULT_STRATEGY: StrategyName = "ddp"
"""The strategy a command trains with when none is asked for."""
DEFAULT_ZERO_STAGE = 2
"""The ZeRO stage the deepspeed strategy trains at when none is asked for."""
ReduceDtype = Literal["float32", "bfloat16"]
"""A dtype FSDP2 may reduce gradients in below the parameters' own (MixedPrecisionPolicy's ``reduce_dtype``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelismConfig:
    """How the ranks hold the model and reduce its gradients: a strategy and its options."""

    strategy: StrategyName = DEFAULT_STRATEGY
    """ddp: each rank a whole replica, gradients all-reduced; fsdp: FSDP2, each rank a shard of every parameter,
    gradients reduce-scattered; hsdp: FSDP2 on a 2-D mesh of ``replicate`` replicas, each sharded over the rest;
    deepspeed: DeepSpeed's engine at ZeRO stage ``zero_stage``, which owns the optimizer (its ranks train in
    float32)."""
    replicate: int | None = None
    """hsdp's replicas, the first dimension of its (replicate, shard) mesh: it must divide the world size."""
    reduce_dtype: ReduceDtype | None = None
    """fsdp and hsdp: reduce the gradients in this dtype (FSDP2's MixedPrecisionPolicy reduce_dtype; default: the
    parameters' own)."""
    zero_stage: int | None = None
    """deepspeed: the ZeRO stage, 0 (the engine's own all-reduce), 1 (optimizer states sharded), 2 (and gradients)
    or 3 (and parameters); default 2."""

    def __post_init__(self):
        one_of("strategy", self.strategy, get_args(StrategyName))
        at_least("replicate", self.replicate)
        if self.reduce_dtype is not None:
            one_of("reduce_dtype", self.reduce_dtype, get_args(ReduceDtype))
        if self.zero_stage is not None:
            one_of("zero_stage", self.zero_stage, (0, 1, 2, 3))

    @property
    def wraps_in_ddp(self) -> bool:
        """Whether the ranks train under DistributedDataParallel (whose find_unused_parameters a check may set)."""
        return self.strategy == DEFAULT_STRATEGY

    def strategy_text(self, world_size: int) -> str:
        """The strategy in a title's words ("fsdp", "hsdp: 2 replicas × 2 shards"); empty for the default, DDP."""
        if self.wraps_in_ddp:
            return ""
        if self.strategy == "deepspeed":
            return f"DeepSpeed ZeRO-{self.engine_zero_stage}"
        if self.replicate and world_size % self.replicate == 0:
            dims = ParallelDims(devices=world_size, replicate_size=self.replicate)
            return f"{self.strategy}: {dims.replicate_size} replicas × {dims.shard_size} shards"
        return self.strategy

    @property
    def engine_zero_stage(self) -> int | None:
        """The ZeRO stage DeepSpeed's engine trains at (its default where none was given); None off DeepSpeed."""
        if self.strategy != "deepspeed":
            return None
        return DEFAULT_ZERO_STAGE if self.zero_stage is None else self.zero_stage

    def strategy_options(self) -> dict[str, Any]:
        """The strategy's options that were given (the strategy refuses one it does not have)."""
        return {name: value for name in ("replicate", "reduce_dtype", "zero_stage")
                if (value := getattr(self, name)) is not None}
