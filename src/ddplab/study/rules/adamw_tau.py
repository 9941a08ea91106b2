"""``adamw-tau``: the square-root rule for AdamW with every setting scaled as ``ddplab plan`` scales it.

At k = B/B_ref: lr × √k; β₁ kept and β₂' = β₂^k, a constant half-life in samples (Marek et al. 2025); ε' = ε/√k
(Malladi et al. 2022); and the decoupled weight decay at a constant timescale in epochs, λ' = λ·k·(η/η') = λ√k
(Wang & Aitchison 2024; Bergsma et al. 2025). The formulas are :mod:`ddplab.plan.scaling`'s. Its optimizer differs
from the grid's: a group of its own.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ddplab.errors import UsageError
from ddplab.plan import scaling
from ddplab.study.rules.base import BatchRuns, OwnGroupRule, round_lr
from ddplab.study.rules.registry import register

if TYPE_CHECKING:
    from ddplab.study.config import OptimizerConfig, StudyConfig


class AdamWTau(OwnGroupRule):
    name = "adamw-tau"
    summary = "lr × √k, β₂' = β₂^k, ε' = ε/√k, weight decay at a constant AdamW timescale λ' = λ√k"
    help = ("adamw-tau is lr × √k with β₂' = β₂^k, ε' = ε/√k and AdamW's weight decay at a constant timescale "
            "(λ' = λ√k)")
    colour = "tab:olive"
    adam_only = True

    def check(self, config: StudyConfig) -> None:
        if config.optimizer.family != "adamw":
            raise UsageError(f"the adamw-tau rule scales AdamW's decoupled weight decay, and the study trains "
                             f"{config.optimizer.name}: it needs {{optimizer.family}} adamw")

    def lr_ratio(self, config: StudyConfig, global_batch: int) -> float:
        """η'/η at ``global_batch``: the square-root rule's √k."""
        return scaling.lr_multiplier(global_batch / config.reference_global_batch_size, "sqrt")

    def runs(self, config: StudyConfig, global_batch: int) -> list[tuple[float, int]]:
        lr = round_lr(config.scale_lr * self.lr_ratio(config, global_batch))
        return [(lr, seed) for seed in range(config.seeds)]

    def optimizer(self, config: StudyConfig, global_batch: int) -> OptimizerConfig:
        k = global_batch / config.reference_global_batch_size
        opt = config.optimizer
        return dataclasses.replace(
            opt, betas=scaling.adam_betas(k, opt.betas), eps=scaling.adam_sqrt_eps(k, opt.eps),
            weight_decay=scaling.adamw_weight_decay(opt.weight_decay, batch_ratio=k,
                                                    lr_ratio=self.lr_ratio(config, global_batch)))

    def variant(self, config: StudyConfig, global_batch: int) -> OptimizerConfig | None:
        return None if global_batch == config.reference_global_batch_size else self.optimizer(config, global_batch)

    def report(self, config: StudyConfig, batches: dict[int, BatchRuns], tuned: list[dict]) -> dict:
        if self.name not in config.rules:
            return {}
        rows = []
        for b in sorted(config.global_batch_sizes):
            optimizer = self.optimizer(config, b)
            lr = self.runs(config, b)[0][0]
            rows.append({"global_batch_size": b, "lr": lr, "betas": list(optimizer.betas), "eps": optimizer.eps,
                         "weight_decay": optimizer.weight_decay,
                         "beta2_half_life_samples": scaling.half_life_steps(optimizer.betas[1]) * b,
                         "timescale_samples": scaling.adamw_timescale_steps(lr=lr,
                                                                            weight_decay=optimizer.weight_decay) * b})
        return {"adamw_tau": rows}

    def lr_text(self, values: dict) -> list[str]:
        tau = values.get("adamw_tau")
        if not tau:
            return []
        return [f"adamw-tau by global batch, lr / β₂ / ε / weight decay (β₁ {tau[0]['betas'][0]:g} kept): "
                + ", ".join(f"{p['global_batch_size']}: {p['lr']:.4g} / {p['betas'][1]:.6g} / {p['eps']:.3g} / "
                            f"{p['weight_decay']:.4g}" for p in tau)]


register(AdamWTau())
