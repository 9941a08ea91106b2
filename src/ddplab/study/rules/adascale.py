"""``adascale``: AdaScale (Johnson et al. 2020) from the reference lr, untuned: each update's lr is the reference lr
times the gain measured from the noise scale, at every batch from the reference up."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddplab.study import fit
from ddplab.study.rules.base import BatchRuns, OwnGroupRule, row
from ddplab.study.rules.registry import register
from ddplab.study.runs import steps

if TYPE_CHECKING:
    from ddplab.study.config import StudyConfig


class AdaScale(OwnGroupRule):
    name = "adascale"
    summary = "the reference lr × AdaScale's measured gain (Johnson et al. 2020), untuned"
    lr_scaling = "gain"
    multi_rank = True

    def runs(self, config: StudyConfig, global_batch: int) -> list[tuple[float, int]]:
        # AdaScale only scales up, and measures from two halves of the batch.
        if self.name not in config.rules or global_batch < max(config.reference_global_batch_size, 2):
            return []
        return [(config.reference_lr, seed) for seed in range(config.seeds)]

    def lr_at(self, view: BatchRuns) -> float | None:
        """The lr its updates took on average: the reference lr × the mean gain recorded at its evaluations."""
        runs = self.seeds_at(view)
        gains = [g[1] for r in runs or [] for g in r.gains]
        return runs[0].lr * sum(gains) / len(gains) if gains else None

    def rows(self, view: BatchRuns) -> list[dict]:
        return [row(self.name, view.global_batch_size, run, gains=run.gains) for run in self.seeds_at(view) or []]

    def report(self, config: StudyConfig, batches: dict[int, BatchRuns], tuned: list[dict]) -> dict:
        """Per batch AdaScale ran at: its median steps beside the best-tuned fixed lr's, and its mean gain."""
        best = {p["global_batch_size"]: p["median_steps"] for p in tuned}
        out = []
        for b, view in sorted(batches.items()):
            runs = self.seeds_at(view)
            if runs is None:
                continue
            median = fit.median([steps(r) for r in runs])
            gains = [g[1] for r in runs for g in r.gains]
            out.append({"global_batch_size": b, "scale": b / config.reference_global_batch_size,
                        "median_steps": median, "tuned_median_steps": best.get(b),
                        "steps_over_tuned": fit.ratio(median, best.get(b)),
                        "mean_gain": sum(gains) / len(gains) if gains else None})
        return {"adascale": out}


register(AdaScale())
