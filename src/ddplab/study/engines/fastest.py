"""``--engine fastest``: before a batch's first group, a step timed on every engine; its groups train on the fastest.

Opt-in: the engines agree only within float32 rounding, which an unstable lr can grow into other steps to target,
and the pick follows the machine's load, so the same command can give other numbers. ``auto`` never times.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddplab.study.engines.base import Engine, Progress
from ddplab.study.engines.registry import kinds

if TYPE_CHECKING:
    from ddplab.study.config import StudyConfig
    from ddplab.study.runs import RunGroup, RunResult
    from ddplab.study.workloads import Workload


def fastest(engines: list[Engine], workload: Workload, config: StudyConfig, group: RunGroup
            ) -> tuple[Engine, dict[str, float]]:
    """The engine whose timed step, times its overhead, is least (the first on a tie); with every timing."""
    seconds = {engine.name: engine.seconds_per_step(workload, config, group) for engine in engines}
    return min(engines, key=lambda engine: seconds[engine.name] * engine.overhead), seconds


class Fastest:
    """``--engine fastest``: before a batch's first group, a step timed on every engine; its groups train on the one
    :func:`fastest` picks."""

    name = "fastest"
    per_run = False

    def __init__(self, engines: list[Engine]):
        self.engines = engines
        self.chosen: dict[int, tuple[Engine, dict[str, float], int]] = {}
        """Per global batch: the engine taken, every engine's seconds per step of the group, and its runs."""

    def train(self, workload: Workload, config: StudyConfig, group: RunGroup,
              progress: Progress | None = None) -> list[RunResult]:
        # Groups measured at every step (AdaScale), or of one run, stay on the first engine: nothing to time.
        if group.lr_scaling != "fixed" or len(group.runs) < 2:
            return self.engines[0].train(workload, config, group, progress)
        b = group.global_batch_size
        if b not in self.chosen:
            self.chosen[b] = (*fastest(self.engines, workload, config, group), len(group.runs))
        return self.chosen[b][0].train(workload, config, group, progress)

    def summary(self) -> tuple[str, str]:
        """(engine, why) for the report: which engine each batch size took, with the timings."""
        if not self.chosen:
            return self.engines[0].name, "no group was timed (each came from the cache or had one run)"
        taken = sorted({engine.name for engine, _, _ in self.chosen.values()}, key=list(kinds()).index)
        parts = [f"{b}: {engine.name} (one step of its {runs} runs: "
                 + ", ".join(f"{name} {duration(s)}" for name, s in seconds.items()) + ")"
                 for b, (engine, seconds, runs) in sorted(self.chosen.items())]
        return "+".join(taken), "timed per global batch, each engine in this process: " + "; ".join(parts)


def duration(seconds: float) -> str:
    """Seconds as a person reads them: '438 ms', '4.09 s' (never an exponent)."""
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s" if seconds < 1000 else f"{seconds:.0f} s"
