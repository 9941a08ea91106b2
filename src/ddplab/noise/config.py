"""What one ``ddplab noise`` run measures (torch-free: the command line reads its defaults)."""

from __future__ import annotations

import dataclasses

from ddplab.errors import UsageError
from ddplab.runtime.config import DEFAULT_WORLD_SIZE, ParallelismConfig, SpecRunConfig
from ddplab.validation import at_least

__all__ = ["DEFAULT_WORLD_SIZE", "NoiseConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoiseConfig(SpecRunConfig, ParallelismConfig):
    """One ``ddplab noise`` run: train a spec on W ranks and measure B_simple from their gradient reduction (DDP's
    all-reduce, FSDP2's reduce-scatter)."""

    per_device_batch_size: int
    """Per-device (per-rank) batch: samples per rank per micro-step (for a command: read from its model's inputs
    unless given)."""
    world_size: int | None = None
    """Ranks (default 2; under torchrun its WORLD_SIZE); 1 works with ``accumulation_steps`` 2 or more (ddp only)."""
    steps: int = 200
    """For a command, the steps measured from --start-step (40 unless given); for a spec, the optimizer steps to
    train."""
    every: int = 1
    """Measure every K-th optimizer step: for a command, from --start-step to the end of training, the curve over
    samples seen; for a spec, every K-th of its steps."""
    accumulation_steps: int = 1
    """Micro-batches of ``per_device_batch_size`` per optimizer step, under no_sync (all but the last)."""

    def __post_init__(self):
        SpecRunConfig.__post_init__(self)
        ParallelismConfig.__post_init__(self)
        for field in ("every", "accumulation_steps"):
            at_least(field, getattr(self, field))
        if self.world_size == 1 and self.accumulation_steps < 2:
            raise UsageError("{world_size} 1 needs {accumulation_steps} 2 or more: the noise scale compares gradients "
                             "over two batch sizes (each rank's and the average, or each micro-batch's and their mean)")
        if self.world_size == 1 and not self.wraps_in_ddp:
            # One process compares micro-batches in its own .grad, which FSDP2 writes only after its reduce-scatter.
            raise UsageError(f"{{strategy}} {self.strategy} measures from its reduce-scatter: it needs {{world_size}} "
                             "2 or more")
