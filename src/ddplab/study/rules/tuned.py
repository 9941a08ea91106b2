"""``tuned``: a sweep of lrs at every batch, the best kept: the ground truth the other rules are judged against.

With Adam or AdamW each lr of the sweep is also trained with every Adam rule's betas, eps and weight decay at that
batch (:func:`ddplab.study.rules.variants`): the best is over lr and those settings, so a rule that changes them
cannot beat the ground truth by a setting the sweep never tried."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ddplab.errors import UsageError
from ddplab.study.rules.base import BatchRuns, GridRule, round_lr
from ddplab.study.rules.registry import register
from ddplab.study.runs import RunResult

if TYPE_CHECKING:
    from ddplab.study.config import StudyConfig


class Tuned(GridRule):
    name = "tuned"
    summary = "a sweep of lrs at every batch, the best kept"
    help = "with Adam the tuned sweep trains each lr with every Adam rule's settings too"
    colour = "tab:green"
    default_for = ("sgd", "adam", "adamw")
    sweeps = True

    def check(self, config: StudyConfig) -> None:
        if len(set(config.global_batch_sizes)) < 2:
            raise UsageError("{global_batch_sizes} needs at least two sizes for a fit")

    def grid_lrs(self, config: StudyConfig, global_batch: int) -> list[float]:
        """A log grid spanning the constant and linear rules' lrs widened by the margin: through the reference lr
        at the reference batch (which trains first), through the lr the rules scale from elsewhere (the best there,
        a point of the same grid, unless given), so the rules' runs never stand outside the sweep they are judged
        by."""
        k = global_batch / config.reference_global_batch_size
        low, high = min(1.0, k) / config.sweep_margin, max(1.0, k) * config.sweep_margin
        step = math.log(config.sweep_factor)
        first, last = math.ceil(math.log(low) / step - 1e-9), math.floor(math.log(high) / step + 1e-9)
        centre = config.reference_lr if global_batch == config.reference_global_batch_size else config.scale_lr
        return [round_lr(centre * config.sweep_factor ** i) for i in range(first, last + 1)]

    def seeds_at(self, view: BatchRuns) -> list[RunResult] | None:
        return view.seeds_at(view.best.lr, view.best.variant) if view.best is not None else None

    def serves(self, run: RunResult, lrs: dict[float, list[str]]) -> bool:
        # Its sweep trains each lr with the study's optimizer and with each Adam rule's settings.
        return not run.rule and self.name in lrs.get(run.lr, [])


register(Tuned())
