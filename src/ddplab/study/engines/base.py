"""What a study engine is: one object that trains a run group and times a step of it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ddplab.study.config import StudyConfig
    from ddplab.study.runs import RunGroup, RunResult
    from ddplab.study.workloads import Workload

Progress = Callable[[int], None]
"""Told each stretch of optimizer steps as a group uses (or skips) them."""


class Engine(Protocol):
    """Trains a study's run groups (``ddplab study --engine NAME``)."""

    name: str
    overhead: float
    """What an in-process timed step leaves out, as a factor: ``--engine fastest`` takes this engine only where its
    timed step times this factor beats every other engine's."""
    per_run: bool
    """It tells progress one stretch of ``max_steps`` per run of a group (else one per group)."""

    def train(self, workload: Workload, config: StudyConfig, group: RunGroup,
              progress: Progress | None = None) -> list[RunResult]:
        """Every run of ``group`` until it reaches the target, diverges, stalls or runs out of steps."""
        ...

    def seconds_per_step(self, workload: Workload, config: StudyConfig, group: RunGroup) -> float:
        """Seconds for one optimizer step of every run in ``group``, timed in this process."""
        ...
