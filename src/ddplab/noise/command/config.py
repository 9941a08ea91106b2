"""What one ``ddplab noise -- COMMAND`` run measures (torch-free: the command line reads its defaults)."""

from __future__ import annotations

import dataclasses

from ddplab.errors import UsageError
from ddplab.guest.runner import check_runnable
from ddplab.noise.guest.plan import StepPlan
from ddplab.validation import at_least, positive

DEFAULT_MEASURED_STEPS = 40
"""Consecutive steps measured without ``every``: 20 batch means of 2 steps for the interval."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommandConfig:
    """One training command run unchanged, its noise scale measured from its own gradient reduction."""

    command: tuple[str, ...]
    """The training command and its arguments."""
    start_step: int = 10
    """The first optimizer step measured (0-based): the first steps, far from where training settles, are skipped."""
    steps: int | None = None
    """Optimizer steps to measure: 40 in a row by default; with ``every``, all until training ends."""
    every: int | None = None
    """Measure every K-th optimizer step from ``start_step`` to the end of training: B_simple over samples seen."""
    per_device_batch_size: int | None = None
    """Samples per rank per micro-step; by default read from the model's inputs (their first dimension)."""
    window: int = 10
    """Measured steps per point of the curve of B_simple over samples seen."""
    deadline_s: float | None = None
    """Seconds after which the command is stopped (SIGTERM) and what was measured reported."""

    def __post_init__(self):
        if not self.command:
            raise UsageError("give the training command after --, e.g. ddplab noise -- torchrun --nproc_per_node 2 "
                             "train.py")
        at_least("start_step", self.start_step)
        for field in ("steps", "every", "per_device_batch_size"):
            at_least(field, getattr(self, field))
        at_least("window", self.window, 2)
        positive("deadline_s", self.deadline_s)
        check_runnable(self.command[0])

    @property
    def measured_steps(self) -> int | None:
        """Steps to measure in all; None: until training ends."""
        if self.steps is not None:
            return self.steps
        return DEFAULT_MEASURED_STEPS if self.every is None else None

    def plan(self) -> StepPlan:
        """The steps the guest measures in every process."""
        return StepPlan(start_step=self.start_step, every=self.every or 1, steps=self.measured_steps,
                        per_device_batch_size=self.per_device_batch_size)
