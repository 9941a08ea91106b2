"""What one ``ddplab noise`` run measures (torch-free: the command line reads its defaults)."""

from __future__ import annotations

import dataclasses

from ddplab.errors import UsageError

DEFAULT_WORLD_SIZE = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoiseConfig:
    """One ``ddplab noise`` run: train a spec on W DDP ranks and measure B_simple from DDP's all-reduce."""

    spec_path: str
    """The training spec file."""
    per_device_batch_size: int
    """Samples per rank per micro-step."""
    world_size: int | None = None
    """DDP ranks; None: 2 (under torchrun, torchrun's WORLD_SIZE). 1 works with accumulation_steps ≥ 2."""
    steps: int = 200
    """Optimizer steps to train."""
    seed: int = 0
    """Model initialisation and data order."""
    every: int = 1
    """Measure every k-th optimizer step (the library's GradientNoiseScale defaults to 4 inside training)."""
    accumulation_steps: int = 1
    """Micro-batches of per_device_batch_size per optimizer step (all but the last under no_sync)."""

    def __post_init__(self):
        for field, value in (("world_size", self.world_size), ("per_device_batch_size", self.per_device_batch_size),
                             ("steps", self.steps), ("every", self.every),
                             ("accumulation_steps", self.accumulation_steps)):
            if value is not None and not value >= 1:
                raise UsageError(f"{{{field}}} must be at least 1, got {value}")
        if self.world_size == 1 and self.accumulation_steps < 2:
            raise UsageError("{world_size} 1 needs {accumulation_steps} 2 or more: the noise scale compares gradients "
                             "over two batch sizes (each rank's and the average, or each micro-batch's and their mean)")
