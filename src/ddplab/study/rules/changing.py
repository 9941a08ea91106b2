"""What the rules whose global batch changes as they train share (``ramp``, ``schedule``): one run per seed from
a starting batch, at the lr a user would have tuned there, and how its runs are read against the tuned fixed runs at
that batch. Each rule gives the adapter that changes the batch (an :class:`~ddplab.adapt.accumulation.
AccumulatedBatch`: BatchRamp, BatchSchedule); the changing-batch engine (:mod:`ddplab.study.engines.changing`)
trains its runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from ddplab.study import fit
from ddplab.study.rules.base import BatchRuns, Rule, round_lr, row
from ddplab.study.rules.sweep import tuned_best
from ddplab.study.runs import RunGroup, RunResult, steps
from ddplab.text import num_or_dash

if TYPE_CHECKING:
    from ddplab.adapt.accumulation import AccumulatedBatch
    from ddplab.study.config import StudyConfig


class ChangingRule(Rule):
    """A rule whose runs change their global batch as they train: one run per seed from its starting batch, at
    the lr a user would have tuned there, each trained in this process after the other."""

    fitted = False
    single_process = True
    batch_changes = True

    def start(self, config: StudyConfig) -> int | None:
        """The global batch its runs start from, or None without the rule."""
        raise NotImplementedError

    def cache_tag(self, config: StudyConfig) -> str:
        """What keeps its runs' cache apart from another setting's of the same rule."""
        return ""

    def micro_batch_size(self, config: StudyConfig) -> int:
        """The micro-batch its runs accumulate (it divides every global batch they reach)."""
        raise NotImplementedError

    def adapter(self, workload, config: StudyConfig, model, optimizer) -> tuple[AccumulatedBatch, Callable[[], None]]:
        """The batch's adapter for one run's model and optimizer, and what to call before each optimizer step."""
        raise NotImplementedError

    def group(self, config: StudyConfig, global_batch: int, trained: dict[int, list[RunResult]]) -> RunGroup | None:
        if global_batch != self.start(config):
            return None
        lr = start_lr(config, global_batch, trained.get(global_batch, []))
        return RunGroup(global_batch_size=global_batch, runs=tuple((lr, seed) for seed in range(config.seeds)),
                        rule=self.name, optimizer=config.optimizer, cache_tag=self.cache_tag(config))

    def stretches(self, config: StudyConfig) -> int:
        return config.seeds if self.name in config.rules else 0

    def seeds_at(self, view: BatchRuns) -> list[RunResult] | None:
        return own_runs(view, self.name)

    def rows(self, view: BatchRuns) -> list[dict]:
        return [row(self.name, view.global_batch_size, run, trajectory=run.trajectory)
                for run in self.seeds_at(view) or []]


    def text(self, values: dict) -> list[str]:
        """Its medians beside the best tuned fixed lr's at its starting batch."""
        summary = (values.get("adaptive") or {}).get(self.name)
        if not summary:
            return []
        versus = "" if summary["fixed_median_steps"] is None else (
            f" vs the best tuned fixed lr's {num_or_dash(summary['fixed_median_steps'])} steps and "
            f"{num_or_dash(summary['fixed_median_samples'])} samples there")
        return [f"{self.name} from global batch {summary['start_global_batch_size']}: median "
                f"{num_or_dash(summary['median_steps'])} steps and {num_or_dash(summary['median_samples'])} "
                f"samples{versus}"]


def start_lr(config: StudyConfig, start: int, trained: list[RunResult]) -> float:
    """The lr runs start at: what a user would have tuned at the starting batch (else the linear rule's)."""
    best = tuned_best(config, start, trained)
    return best.lr if best else round_lr(config.scale_lr * start / config.reference_global_batch_size)


def own_runs(view: BatchRuns, name: str) -> list[RunResult] | None:
    """The runs of rule ``name``'s group at the view's batch, by seed; None where it has none."""
    own = view.own.get(name, {})
    return [own[seed] for seed in sorted(own)] or None


def medians(runs: list[RunResult]) -> tuple[float, float]:
    """Median steps and median samples to the target (inf where the median run did not arrive)."""
    samples = [float(r.samples_to_target) if r.samples_to_target is not None else math.inf for r in runs]
    return fit.median([steps(r) for r in runs]), fit.median(samples)


def adaptive(start: int, runs: list[RunResult], tuned: list[dict]) -> dict:
    """The ``adaptive`` entry of a rule whose batch changes: its medians beside the tuned fixed runs' at ``start``
    (None where no tuned median arrived there)."""
    median_steps, median_samples = medians(runs)
    fixed = next((p["median_steps"] for p in tuned if p["global_batch_size"] == start), None)
    return {"median_steps": median_steps, "median_samples": median_samples, "start_global_batch_size": start,
            "fixed_median_steps": fixed, "fixed_median_samples": fixed * start if fixed is not None else None}
