"""What a plan answers: the :class:`Plan`, and a measured lr that may stand in for a rule (no torch)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ddplab.errors import UsageError
from ddplab.plan import mesh, scaling
from ddplab.plan.inputs import Keep, PlanRule


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeasuredLr:
    """An lr measured at the target's global batch (``ddplab study``), planned from in place of a rule."""

    lr: float
    reason: str
    """Where the number comes from, for the table's "why" column (a template, as a UsageError's)."""
    warnings: tuple[str, ...] = ()
    """Templates too."""


LrSource = Callable[[int], MeasuredLr]
"""Given the planned global batch, the lr to use there."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """What to run on the target, and why."""

    mode: Keep
    rule: PlanRule
    world_size: int
    data_parallel_size: int
    """The ranks that load distinct samples: world size ÷ (tp × pp × cp); every batch and lr rule counts these."""
    tensor_parallel_size: int
    pipeline_parallel_size: int
    context_parallel_size: int
    strategy: mesh.Strategy
    data_parallel_replicate_size: int | None
    """Replicas over the data-parallel ranks (all of them under DDP, 1 under FSDP2; None for HSDP without one)."""
    data_parallel_shard_size: int | None
    """Ranks one replica is sharded over (1 under DDP, all of them under FSDP2; None for HSDP without a replicate)."""
    per_device_batch_size: int
    accumulation_steps: int
    global_batch_size: int
    tokens_per_step: int | None
    """Global batch × sequence length; None without ``data.seq_len``."""
    reference_global_batch_size: int
    reference_data_parallel_size: int
    reference_tokens_per_step: int | None
    batch_ratio: float
    lr: float
    lr_multiplier: float
    betas: tuple[float, float] | None
    eps: float | None
    weight_decay: float | None
    adamw_timescale_epochs: float | None
    """AdamW's averaging timescale B/(η·λ·N) in epochs; None without decay, for Adam or without a dataset size."""
    adamw_timescale_steps: float | None
    """The same timescale in optimizer steps, 1/(η·λ) (no dataset size needed); None without decay or for Adam."""
    warmup_recommended: bool
    warmup_steps: int | None
    warmup_epochs: float | None
    samples_per_rank: int | None
    padded_samples: int | None
    dropped_samples: int | None
    loader_batches_per_rank: int | None
    steps_per_epoch: int | None
    total_steps: int | None
    samples_per_epoch: int | None
    steps_factor: float | None
    compute_factor: float | None
    other_mode: str
    warnings: tuple[str, ...]
    reasons: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["warnings"] = list(self.warnings)
        if self.betas is None:
            for key in ("betas", "eps", "weight_decay", "adamw_timescale_epochs", "adamw_timescale_steps"):
                out.pop(key)
        return out

    def lr_lambda(self, step: int) -> float:
        """LambdaLR factor on ``self.lr``: linear warmup over ``warmup_steps`` (the table's), then 1.

        Raises UsageError when warmup is recommended but its length is unknown (no dataset size or
        warmup steps): skipping the warmup silently would start at the full scaled lr.
        """
        self._require_warmup_length()
        return scaling.warmup_factor(step, warmup_steps=self.warmup_steps or 0, lr_multiplier=self.lr_multiplier)

    def scheduler(self, optimizer):
        """A ``torch.optim.lr_scheduler.LambdaLR`` for an optimizer built with ``lr=plan.lr`` (imports torch)."""
        self._require_warmup_length()
        from torch.optim.lr_scheduler import LambdaLR

        return LambdaLR(optimizer, self.lr_lambda)

    def _require_warmup_length(self) -> None:
        if self.warmup_recommended and self.warmup_steps is None:
            raise UsageError(f"warmup is recommended (lr ×{self.lr_multiplier:.4g}) but its length is unknown: "
                             "plan with {data.dataset_size} or {data.warmup_steps}")
