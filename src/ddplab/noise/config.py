"""What one ``ddplab noise`` run measures (torch-free: the command line reads its defaults)."""

from __future__ import annotations

import dataclasses

from ddplab.errors import UsageError
from ddplab.runtime.config import DEFAULT_WORLD_SIZE, SpecRunConfig
from ddplab.validation import at_least

__all__ = ["DEFAULT_WORLD_SIZE", "NoiseConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoiseConfig(SpecRunConfig):
    """One ``ddplab noise`` run: train a spec on W DDP ranks and measure B_simple from DDP's all-reduce."""

    per_device_batch_size: int
    """Per-device (per-rank) batch: samples per rank per micro-step."""
    world_size: int | None = None
    """DDP ranks (default 2; under torchrun its WORLD_SIZE); 1 works with ``accumulation_steps`` 2 or more."""
    steps: int = 200
    """Optimizer steps to train."""
    every: int = 1
    """Measure every K-th optimizer step (the library's GradientNoiseScale defaults to 4 inside training)."""
    accumulation_steps: int = 1
    """Micro-batches of ``per_device_batch_size`` per optimizer step, under no_sync (all but the last)."""

    def __post_init__(self):
        super().__post_init__()
        for field in ("every", "accumulation_steps"):
            at_least(field, getattr(self, field))
        if self.world_size == 1 and self.accumulation_steps < 2:
            raise UsageError("{world_size} 1 needs {accumulation_steps} 2 or more: the noise scale compares gradients "
                             "over two batch sizes (each rank's and the average, or each micro-batch's and their mean)")
