"""The record of a critical-batch measurement: ``branched.json``.
"""

from __future__ import annotations

import dataclasses

from ddplab.serialize import finite
from ddplab.study.branched import schedule
from ddplab.study.branched.config import BranchConfig
from ddplab.study.config import StudyConfig
from ddplab.study.engines.choice import BranchEngine


@dataclasses.dataclass(kw_only=True)
class BranchReport:
    """The critical batch at each checkpoint, the schedule it implies and what the measurement cost."""

    workload: str
    config: StudyConfig
    branch: BranchConfig
    lr_rule: str
    samples: int
    """Samples every branch trained."""
    branches: list[dict]
    schedule: list[dict]
    reference_run: dict | None
    """The reference run ``branch_at`` trained: its steps to the target, whether it reached it, its samples."""
    branch_samples_total: int
    out: str
    engine: BranchEngine = "vmap"
    """What trained the branches: vmap (vectorized, in this process) or ddp (real ranks)."""
    engine_reason: str = ""
    world_size: int | None = None
    """The ranks the ddp engine trained the branches on (None: vectorized)."""
    strategy: str | None = None
    """Their parallelism strategy: ddp, fsdp or hsdp (None: vectorized)."""
    own_optimizer: dict | None = None
    """The spec's own optimizer, where the branches trained with it instead of the config's (optim.describe)."""
    seconds: float = 0.0
    plots: list[str] = dataclasses.field(default_factory=list)
    """The figure drawn (branched.png), once it is."""

    @property
    def reference_samples(self) -> int | None:
        """One reference run's samples: the one trained here, else the latest checkpoint's samples seen."""
        if self.reference_run is not None:
            return self.reference_run["samples"]
        return max((b["samples_seen"] for b in self.branches), default=0) or None

    def to_json(self) -> dict:
        cfg = self.config
        reference = self.reference_samples
        return finite({
            "workload": self.workload, "optimizer": self.own_optimizer or cfg.optimizer.to_json(),
            "engine": self.engine, "engine_reason": self.engine_reason, "world_size": self.world_size,
            "strategy": self.strategy,
            "reference": {"global_batch_size": cfg.reference_global_batch_size, "lr": cfg.reference_lr},
            "global_batch_sizes": list(self.branch.global_batch_sizes(cfg.reference_global_batch_size)),
            "lr_rule": self.lr_rule, "sweep_factor": cfg.sweep_factor, "seeds": cfg.seeds,
            "branch_samples": self.samples, "dtype": cfg.dtype,
            "tolerance": ("given" if self.branch.branch_tolerance is not None else
                          f"lag {self.branch.branch_lag:g}" if self.branch.branch_lag is not None else "seeds")
                         + (", paired" if self.branch.branch_paired else ""),
            "reference_run": self.reference_run, "branches": self.branches, "schedule": self.schedule,
            "step_batch_size_schedule": schedule.megatron_schedule(self.schedule),
            "cost": {"branch_samples": self.branch_samples_total, "reference_samples": reference,
                     "relative": self.branch_samples_total / reference if reference else None,
                     "per_checkpoint_relative": [b["branch_samples"] / reference if reference else None
                                                 for b in self.branches]},
            "out": self.out, "seconds": self.seconds, **({"plots": self.plots} if self.plots else {}),
        })
