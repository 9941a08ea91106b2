"""What a study found, as one result: the grid, the fits, B_simple, warnings, and where its files are."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ddplab.serialize import finite
from ddplab.study.config import StudyConfig
from ddplab.study.grid.analysis import StudyAnalysis

if TYPE_CHECKING:
    # An annotation: replaying on DDP ranks imports torch, reading a report does not.
    from ddplab.study.grid.verify import VerifyResult


TRAINING_LOSS = "training loss"
"""What a command study without --metric reads its target from: the loss that reached backward."""


@dataclasses.dataclass(kw_only=True)
class StudyReport:
    workload: str
    config: StudyConfig
    train_size: int
    analysis: StudyAnalysis
    out: str
    engine: str = "vmap"
    """Which engine trained the grid."""
    engine_reason: str = ""
    """Why that engine."""
    device: str = "cpu"
    target_read: str | None = None
    """What the target is read from where it is not a spec's validation set: TRAINING_LOSS, or the metric a
    command prints."""
    own_optimizer: dict | None = None
    """The spec's own optimizer, where the runs trained with it instead of the config's (optim.describe)."""
    verify_ddp: VerifyResult | None = None
    plots: list[str] = dataclasses.field(default_factory=list)
    report: str | None = None
    """The HTML report's path, once written."""
    seconds: float = 0.0

    @property
    def trained_runs(self) -> int:
        """Runs trained (or read from the cache): one per (batch, lr, seed, variant), whichever rules it serves."""
        from ddplab.study.rules import registry

        return len({(r["global_batch_size"], r["lr"], r["seed"], r.get("variant", ""),
                     "" if registry.get(r["rule"]).shares_grid else r["rule"]) for r in self.analysis.runs})

    def to_json(self) -> dict[str, Any]:
        cfg, analysis = self.config, self.analysis
        out = {
            "workload": self.workload, "target": cfg.target.to_json(), "target_read": self.target_read,
            "rules": list(cfg.rules),
            "global_batch_sizes": sorted(cfg.global_batch_sizes),
            "reference": {"global_batch_size": cfg.reference_global_batch_size, "lr": cfg.reference_lr,
                          "rules_lr": analysis.rules_lr},
            "seeds": cfg.seeds, "max_steps": cfg.max_steps, "eval_every": cfg.eval_every, "patience": cfg.patience,
            "dtype": cfg.dtype, "train_size": self.train_size,
            "optimizer": self.own_optimizer or cfg.optimizer.to_json(),
            "engine": self.engine, "engine_reason": self.engine_reason, "device": self.device,
            "runs": analysis.runs, "trained_runs": self.trained_runs, "tuned_lr": analysis.tuned_lr,
            "fit": analysis.fit, "b_simple": analysis.b_simple, "warnings": analysis.warnings,
            "unreached": analysis.unreached, "scorecard": analysis.scorecard,
            "scorecard_note": analysis.scorecard_note, "lr_peak": analysis.lr_peak,
            **analysis.sections,
            "plots": self.plots, "report": self.report, "out": self.out,
        }
        if self.verify_ddp is not None:
            out["verify_ddp"] = self.verify_ddp.to_json()
        out["seconds"] = self.seconds
        return finite(out)


def optimizer_text(optimizer: dict) -> str:
    """The optimizer of a study's JSON as one line: its class and hyperparameters."""
    settings = ", ".join(f"{k} {v}" for k, v in optimizer.items() if k not in ("family", "name"))
    return f"{optimizer['name']} ({settings})" if settings else optimizer["name"]
