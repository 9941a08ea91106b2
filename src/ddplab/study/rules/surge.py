"""``surge``: Li et al.'s (2024, "Surge phenomenon") best Adam lr, which peaks at the noise scale.

η*(B) = η_max / (½(√(B_noise/B) + √(B/B_noise))): it grows as √B below B_noise, peaks there and falls as 1/√B
above it. The rule trains lr = the reference lr × η*(B)/η*(B_ref) (:func:`ddplab.plan.scaling.surge_lr_multiplier`)
with the study's optimizer. B_noise is ``noise_scale`` where given, else the study's own B_simple, measured along
the best tuned runs at the reference batch (the grid's runs there train before any rule's own group; the study
trains that batch even where ``global_batch_sizes`` leaves it out, and says so). Without a sweep or ``noise_scale``
the study refuses to start; where the measurement fails (the best runs there never reached the target, or B_simple
is not a positive number) the rule is skipped with a warning that says so.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ddplab.errors import UsageError
from ddplab.plan import scaling
from ddplab.study.rules.base import BatchRuns, OwnGroupRule, round_lr
from ddplab.study.rules.registry import register, sweeping
from ddplab.study.rules.sweep import b_simple_at
from ddplab.study.runs import RunGroup, RunResult
from ddplab.text import num_or_dash

if TYPE_CHECKING:
    from ddplab.study.config import StudyConfig


class Surge(OwnGroupRule):
    name = "surge"
    summary = "lr × η*(B)/η*(B_ref), Adam's best lr rising to B_noise and falling past it (Li et al. 2024)"
    help = ("surge is Li et al.'s lr peaking at B_noise (``noise_scale``, else the B_simple measured at the reference "
            "batch)")
    colour = "tab:cyan"
    adam_only = True

    def check(self, config: StudyConfig) -> None:
        if not config.optimizer.adam:
            raise UsageError(f"the surge rule describes Adam's best lr, and the study trains {config.optimizer.name}: "
                             "it needs {optimizer.family} adam or adamw")
        if config.noise_scale is None and sweeping(config) is None:
            raise UsageError("the surge rule needs B_noise: give {noise_scale}, or keep tuned in {rules}, whose best "
                             f"runs at the reference batch {config.reference_global_batch_size} measure B_simple")

    def measures_at_reference(self, config: StudyConfig) -> str | None:
        if config.noise_scale is not None:
            return None
        return "B_noise, the B_simple along the best tuned runs (--noise-scale gives it instead)"

    def noise_scale(self, config: StudyConfig, trained: dict[int, list[RunResult]]) -> float | None:
        """B_noise: ``noise_scale`` where given, else B_simple along the best tuned runs at the reference batch;
        None where that is not a positive number."""
        if config.noise_scale is not None:
            return config.noise_scale
        reference = config.reference_global_batch_size
        value = b_simple_at(config, reference, trained.get(reference, []))
        return value if value is not None and math.isfinite(value) and value > 0 else None

    def lr(self, config: StudyConfig, global_batch: int, noise_scale: float) -> float:
        return round_lr(config.scale_lr * scaling.surge_lr_multiplier(config.reference_global_batch_size,
                                                                          global_batch, noise_scale))

    def group(self, config: StudyConfig, global_batch: int, trained: dict[int, list[RunResult]]) -> RunGroup | None:
        noise_scale = self.noise_scale(config, trained)
        if noise_scale is None:
            return None
        lr = self.lr(config, global_batch, noise_scale)
        return RunGroup(global_batch_size=global_batch, runs=tuple((lr, seed) for seed in range(config.seeds)),
                        rule=self.name, optimizer=config.optimizer)

    def stretches(self, config: StudyConfig) -> int:
        # A group at every batch (unless B_noise turns out unmeasurable: then the bar ends short of its total).
        return len(config.global_batch_sizes)

    def report(self, config: StudyConfig, batches: dict[int, BatchRuns], tuned: list[dict]) -> dict:
        if self.name not in config.rules:
            return {}
        noise_scale = self.noise_scale(config, _fixed_runs(batches))
        if noise_scale is None:
            return {"surge": None}
        rows = [{"global_batch_size": b, "lr": self.lr(config, b, noise_scale),
                 "multiplier": scaling.surge_lr_multiplier(config.reference_global_batch_size, b, noise_scale),
                 "outside_surge_range": scaling.outside_surge_range(b, noise_scale)}
                for b in sorted(config.global_batch_sizes)]
        source = "given" if config.noise_scale is not None else "b_simple_at_reference"
        return {"surge": {"noise_scale": noise_scale, "source": source, "by_batch": rows}}

    def warnings(self, config: StudyConfig, batches: dict[int, BatchRuns]) -> list[str]:
        if self.name not in config.rules:
            return []
        noise_scale = self.noise_scale(config, _fixed_runs(batches))
        if noise_scale is None:
            return [f"the surge rule did not run: B_simple along the best tuned runs at the reference batch "
                    f"{config.reference_global_batch_size} is not a positive number (the runs there never reached "
                    "the target, or |G|² could not be told from its noise); give --noise-scale"]
        far = [b for b in sorted(config.global_batch_sizes) if scaling.outside_surge_range(b, noise_scale)]
        if not far:
            return []
        return [f"the surge rule's B_noise {noise_scale:.4g} is more than {scaling.SURGE_RANGE:g}× from global batch "
                f"{', '.join(map(str, far))}: its lr there extrapolates the curve far from its peak"]


    def lr_text(self, values: dict) -> list[str]:
        surge = values.get("surge")
        if not surge:
            return []
        source = "given" if surge["source"] == "given" else "B_simple at the reference batch"
        return [f"surge rule: B_noise {num_or_dash(surge['noise_scale'])} ({source}); lr by global batch: "
                + ", ".join(f"{p['global_batch_size']}: {p['lr']:.4g}" for p in surge["by_batch"])]


def _fixed_runs(batches: dict[int, BatchRuns]) -> dict[int, list[RunResult]]:
    return {b: list(view.fixed.values()) for b, view in batches.items()}


register(Surge())
