"""What one ``ddplab check`` compares (torch-free: the command line reads its defaults)."""

from __future__ import annotations

import dataclasses

from ddplab.runtime.config import DEFAULT_WORLD_SIZE, ParallelismConfig, SpecRunConfig
from ddplab.validation import positive

__all__ = ["DEFAULT_WORLD_SIZE", "FLOAT32_TOLERANCE", "FLOAT64_TOLERANCE", "CheckConfig"]

FLOAT64_TOLERANCE = 1e-9
"""The default tolerance where both sides train in float64: far above its rounding over a few steps."""
FLOAT32_TOLERANCE = 1e-5
"""The default tolerance where the ranks train in float32 (DeepSpeed's engine reduces no float64) against a float64
reference: a few steps' float32 rounding, far below what any cause the check names changes."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckConfig(SpecRunConfig, ParallelismConfig):
    """One ``ddplab check`` run: W ranks of b samples each (under a parallelism strategy) against one process with
    W·b."""

    steps: int = 5
    """Optimizer steps to compare."""
    tolerance: float | None = None
    """Largest relative parameter difference called equal, relative to the largest parameter: by default 1e-9 in
    float64, 1e-5 where the ranks train in float32 (DeepSpeed)."""
    accumulation_steps: int = 1
    """Micro-batches of ``per_device_batch_size`` each rank accumulates per optimizer step (all but the last under
    no_sync, or FSDP2's set_requires_gradient_sync(False)), each loss divided by their number."""

    def __post_init__(self):
        SpecRunConfig.__post_init__(self)
        ParallelismConfig.__post_init__(self)
        if self.tolerance is None:
            # Frozen: the default is resolved once, so every reader sees the number the ranks were judged by.
            object.__setattr__(self, "tolerance", FLOAT32_TOLERANCE if self.strategy == "deepspeed" else
                               FLOAT64_TOLERANCE)
        positive("tolerance", self.tolerance)
        positive("accumulation_steps", self.accumulation_steps)

    @property
    def rank_step_batch_size(self) -> int:
        """Samples each rank trains on per optimizer step: its micro-batches together."""
        return self.per_device_batch_size * self.accumulation_steps

    @property
    def global_batch_size(self) -> int:
        return self.rank_step_batch_size * (self.world_size or DEFAULT_WORLD_SIZE)
