"""What one ``ddplab check`` compares (torch-free: the command line reads its defaults)."""

from __future__ import annotations

import dataclasses
import math

from ddplab.errors import UsageError

DEFAULT_WORLD_SIZE = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckConfig:
    """One ``ddplab check`` run: W ranks of b samples each against one process with W·b."""

    spec_path: str
    """The training spec file (model(), dataset(), loss(), optionally optimizer() and step())."""
    per_device_batch_size: int
    """Samples per rank per step."""
    world_size: int | None = None
    """DDP ranks; None: 2 (under torchrun, torchrun's WORLD_SIZE)."""
    steps: int = 5
    """Optimizer steps to compare."""
    seed: int = 0
    """Model initialisation and data order."""
    tolerance: float = 1e-9
    """Largest parameter difference, relative to the largest parameter, still called equal (float64)."""

    def __post_init__(self):
        for field, value in (("world_size", self.world_size), ("per_device_batch_size", self.per_device_batch_size),
                             ("steps", self.steps)):
            if value is not None and not value >= 1:
                raise UsageError(f"{{{field}}} must be at least 1, got {value}")
        if not 0 < self.tolerance < math.inf:
            raise UsageError(f"{{tolerance}} must be a positive number, got {self.tolerance}")

    @property
    def global_batch_size(self) -> int:
        return self.per_device_batch_size * (self.world_size or DEFAULT_WORLD_SIZE)
