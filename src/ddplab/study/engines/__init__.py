"""The study's engines, registered by name, and ``--engine auto``: each group trained where a timed step says.

- ``vmap`` (:mod:`ddplab.study.engines.vmap`): every run of a group in one process, vectorized;
- ``ddp`` (:mod:`ddplab.study.engines.ddp`): each run on real DDP ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddplab.study.engines.base import Engine, Progress

if TYPE_CHECKING:
    from ddplab.study.config import StudyConfig
    from ddplab.study.runs import RunGroup, RunResult
    from ddplab.study.workloads import Workload

NAMES = ("vmap", "ddp")
"""The registered engines, in auto's order of preference (a tie goes to the first)."""


def fastest(engines: list[Engine], workload: Workload, config: StudyConfig, group: RunGroup
            ) -> tuple[Engine, dict[str, float]]:
    """The engine whose timed step, times its overhead, is least (the first on a tie); with every timing."""
    seconds = {engine.name: engine.seconds_per_step(workload, config, group) for engine in engines}
    return min(engines, key=lambda engine: seconds[engine.name] * engine.overhead), seconds


class Auto:
    """``--engine auto``: before a batch's first group, a step timed on every engine; its groups train on the one
    :func:`fastest` picks."""

    name = "auto"

    def __init__(self, engines: list[Engine]):
        self.engines = engines
        self.chosen: dict[int, tuple[Engine, dict[str, float]]] = {}
        """Per global batch: the engine taken and every engine's seconds per step."""

    def train(self, workload: Workload, config: StudyConfig, group: RunGroup,
              progress: Progress | None = None) -> list[RunResult]:
        # Groups measured at every step (AdaScale), or of one run, stay on the first engine: nothing to time.
        if group.lr_scaling != "fixed" or len(group.runs) < 2:
            return self.engines[0].train(workload, config, group, progress)
        b = group.global_batch_size
        if b not in self.chosen:
            self.chosen[b] = fastest(self.engines, workload, config, group)
        return self.chosen[b][0].train(workload, config, group, progress)

    def summary(self) -> tuple[str, str]:
        """(engine, why) for the report: which engine each batch size took, with the timings."""
        if not self.chosen:
            return self.engines[0].name, "no group was timed (each came from the cache or had one run)"
        taken = sorted({engine.name for engine, _ in self.chosen.values()}, key=NAMES.index)
        parts = [f"{b}: {engine.name} (" + ", ".join(f"{name} {_ms(s)}" for name, s in seconds.items()) + ")"
                 for b, (engine, seconds) in sorted(self.chosen.items())]
        return "+".join(taken), "seconds per step timed per global batch: " + "; ".join(parts)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


__all__ = ["NAMES", "Auto", "Engine", "Progress", "fastest"]
