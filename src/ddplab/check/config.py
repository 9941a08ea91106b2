"""What one ``ddplab check`` compares (torch-free: the command line reads its defaults)."""

from __future__ import annotations

import dataclasses

from ddplab.runtime.config import DEFAULT_WORLD_SIZE, ParallelismConfig, SpecRunConfig
from ddplab.validation import positive

__all__ = ["DEFAULT_WORLD_SIZE", "CheckConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckConfig(SpecRunConfig, ParallelismConfig):
    """One ``ddplab check`` run: W ranks of b samples each (under a parallelism strategy) against one process with
    W·b."""

    steps: int = 5
    """Optimizer steps to compare."""
    tolerance: float = 1e-9
    """Largest relative parameter difference called equal: relative to the largest parameter, in float64."""
    accumulation_steps: int = 1
    """Micro-batches of ``per_device_batch_size`` each rank accumulates per optimizer step (all but the last under
    no_sync, or FSDP2's set_requires_gradient_sync(False)), each loss divided by their number."""

    def __post_init__(self):
        SpecRunConfig.__post_init__(self)
        ParallelismConfig.__post_init__(self)
        positive("tolerance", self.tolerance)
        positive("accumulation_steps", self.accumulation_steps)

    @property
    def rank_step_batch_size(self) -> int:
        """Samples each rank trains on per optimizer step: its micro-batches together."""
        return self.per_device_batch_size * self.accumulation_steps

    @property
    def global_batch_size(self) -> int:
        return self.rank_step_batch_size * (self.world_size or DEFAULT_WORLD_SIZE)
