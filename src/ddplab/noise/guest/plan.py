"""Which optimizer steps the guest measures, passed from ``ddplab noise`` to every process through its environment.

Torch-free: the parent builds it from its config, the guest reads it back after ``import torch``.
"""

from __future__ import annotations

import dataclasses
import os

ENV_PLAN = "DDPLAB_NOISE_PLAN"
ENV_GUEST = "DDPLAB_GUEST"
GUEST_MODULE = "ddplab.noise.guest.install"


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepPlan:
    """The optimizer steps (0-based, counted per model) whose gradients are measured."""

    start_step: int
    """The first measured step."""
    every: int = 1
    """Measure every K-th step from ``start_step``."""
    steps: int | None = None
    """Measured steps in all; None: until training ends."""
    per_device_batch_size: int | None = None
    """Samples per rank per micro-step, when given instead of read from the model's inputs."""

    def measures(self, step: int) -> bool:
        offset = step - self.start_step
        return offset >= 0 and offset % self.every == 0 and not self.finished(step)

    def finished(self, step: int) -> bool:
        """No step from ``step`` on is measured."""
        return self.steps is not None and step >= self.start_step + self.every * (self.steps - 1) + 1

    def to_env(self) -> dict[str, str]:
        """The environment that arms the guest with this plan."""
        values = [self.start_step, self.every, self.steps, self.per_device_batch_size]
        return {ENV_GUEST: GUEST_MODULE, ENV_PLAN: ",".join("" if v is None else str(v) for v in values)}

    @classmethod
    def from_env(cls) -> StepPlan | None:
        text = os.environ.get(ENV_PLAN)
        if not text:
            return None
        start, every, steps, batch = (int(v) if v else None for v in text.split(","))
        return cls(start_step=start, every=every, steps=steps, per_device_batch_size=batch)
