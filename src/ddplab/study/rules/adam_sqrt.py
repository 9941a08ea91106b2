"""``adam-sqrt``: Malladi et al.'s (2022) square-root rule for Adam, lr × √k with 1 − β' = k(1 − β) and
ε' = ε/√k, as derived (``ddplab plan`` now keeps β₁ and takes β₂' = β₂^k, Marek et al. 2025). Its betas and eps
differ from the grid's: a group of its own."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from ddplab.errors import UsageError
from ddplab.study.rules.base import BatchRuns, OwnGroupRule, round_lr
from ddplab.study.rules.registry import register

if TYPE_CHECKING:
    from ddplab.study.config import OptimizerConfig, StudyConfig


class AdamSqrt(OwnGroupRule):
    name = "adam-sqrt"
    summary = "lr × √k, 1 − β' = k(1 − β), ε' = ε/√k (Malladi et al. 2022)"
    help = "adam-sqrt is Malladi et al.'s rule (lr × √k, 1 − β' = k(1 − β), ε' = ε/√k)"
    colour = "tab:brown"
    default_for = ("adam", "adamw")
    adam_only = True

    def check(self, config: StudyConfig) -> None:
        if not config.optimizer.adam:
            raise UsageError(f"the adam-sqrt rule scales Adam's betas and eps, and the study trains "
                             f"{config.optimizer.name}: it needs {{optimizer.family}} adam or adamw")

    def runs(self, config: StudyConfig, global_batch: int) -> list[tuple[float, int]]:
        k = global_batch / config.reference_global_batch_size
        return [(round_lr(config.scale_lr * math.sqrt(k)), seed) for seed in range(config.seeds)]

    def scaled(self, config: StudyConfig, global_batch: int) -> tuple[OptimizerConfig, list[str]]:
        """The optimizer at ``global_batch``: 1 − β' = k(1 − β) (clamped at 0) and ε' = ε/√k; with
        what was clamped."""
        k = global_batch / config.reference_global_batch_size
        opt = config.optimizer
        betas = tuple(1.0 - k * (1.0 - b) for b in opt.betas)
        clamped = [f"β{i + 1}" for i, b in enumerate(betas) if b < 0]
        return dataclasses.replace(opt, betas=tuple(max(b, 0.0) for b in betas), eps=opt.eps / math.sqrt(k)), clamped

    def optimizer(self, config: StudyConfig, global_batch: int) -> OptimizerConfig:
        return self.scaled(config, global_batch)[0]

    def variant(self, config: StudyConfig, global_batch: int) -> OptimizerConfig | None:
        # At the reference there is nothing to scale (1 − (1 − β) may differ from β by a rounding).
        return None if global_batch == config.reference_global_batch_size else self.optimizer(config, global_batch)

    def report(self, config: StudyConfig, batches: dict[int, BatchRuns], tuned: list[dict]) -> dict:
        if self.name not in config.rules:
            return {}
        rows = []
        for b in sorted(config.global_batch_sizes):
            optimizer, clamped = self.scaled(config, b)
            rows.append({"global_batch_size": b, "lr": self.runs(config, b)[0][0], "betas": list(optimizer.betas),
                         "eps": optimizer.eps, "clamped": clamped})
        return {"adam_sqrt": rows}

    def warnings(self, config: StudyConfig, batches: dict[int, BatchRuns]) -> list[str]:
        at = sorted(b for b, view in batches.items() if self.name in view.own and self.scaled(config, b)[1])
        if not at:
            return []
        return [f"the adam-sqrt rule's 1 − k(1 − β) falls below 0 at global batch {', '.join(map(str, at))}: clamped "
                "to 0; the rule was derived for batches that grow less than 1/(1 − β₁) (ddplab plan keeps β₁ instead)"]


register(AdamSqrt())
