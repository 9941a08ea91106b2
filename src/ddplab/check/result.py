"""What ``ddplab check`` found: a verdict, its cause when one is confirmed, and the per-step differences."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from ddplab.check.config import CheckConfig
from ddplab.serialize import finite

Verdict = Literal["EQUIVALENT", "ROUNDING", "DIVERGES", "STOCHASTIC", "NON_FINITE"]
Cause = Literal["SUM_REDUCTION", "GRADIENT_SCALE", "DIVIDE_FACTOR", "REDUCE_PRECISION", "PADDING", "BATCHNORM",
                "LOSS_NORMALISED_PER_DEVICE", "LOSS_NORMALISED_PER_MICRO_BATCH", "UNUSED_PARAMETERS_STEPPED",
                "RANDOMNESS", "UNKNOWN"]
Side = Literal["ranks", "single_process", "both"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckResult:
    config: CheckConfig
    """The run, its world size resolved."""
    verdict: Verdict
    cause: Cause | None
    explanation: str
    fix: str | None
    per_step: list[dict[str, float]]
    """Per optimizer step: max_abs_diff, max_rel_diff and samples_per_rank; under a reduce_dtype also
    reduction_error_of_bound (the reduced gradient's largest difference from the exact average, as a fraction of the
    reduce dtype's rounding bound)."""
    first_divergent_step: int | None
    has_padding: bool
    non_finite: dict[str, Any] | None = None
    """Where inf or nan first appeared: step, side ('ranks', 'single_process' or 'both') and what."""
    unused_parameters: tuple[str, ...] = ()
    """Parameters without a gradient on the first global batch."""
    find_unused_parameters: bool = False
    """Whether DDP looked for unused parameters (some parameter was unused on some step)."""
    note: str | None = None
    """What the verdict cannot show with this setting (one rank compares no ranks); None when nothing."""

    @property
    def passed(self) -> bool:
        """The ranks and the single process agree at every step, or differ by a reduce_dtype's rounding only."""
        return self.verdict in ("EQUIVALENT", "ROUNDING")

    @property
    def partial_steps(self) -> list[tuple[int, int]]:
        """(step, samples per rank) of steps whose batch was smaller than the per-device batch (an epoch's end)."""
        batch = self.config.rank_step_batch_size
        return [(i, d["samples_per_rank"]) for i, d in enumerate(self.per_step) if d["samples_per_rank"] != batch]

    def to_json(self) -> dict[str, Any]:
        cfg = self.config
        return finite({"verdict": self.verdict, "cause": self.cause, "explanation": self.explanation, "fix": self.fix,
                       "tolerance": cfg.tolerance, "strategy": cfg.strategy, "replicate": cfg.replicate,
                       "reduce_dtype": cfg.reduce_dtype, "zero_stage": cfg.engine_zero_stage,
                       "world_size": cfg.world_size, "data_parallel_size": cfg.world_size,
                       "per_device_batch_size": cfg.per_device_batch_size, "accumulation_steps": cfg.accumulation_steps,
                       "global_batch_size": cfg.global_batch_size,
                       "steps": cfg.steps, "seed": cfg.seed, "first_divergent_step": self.first_divergent_step,
                       "non_finite": self.non_finite, "unused_parameters": list(self.unused_parameters),
                       "find_unused_parameters": self.find_unused_parameters, "note": self.note,
                       "per_step": self.per_step})
