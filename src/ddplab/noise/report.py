"""What ``ddplab noise`` measured: B_simple with its interval, what it predicts, and every measured step.

Pure Python: built in the rank that measured (or, for a run stopped early, in the parent from the
rank's journal), and read by the command line and by scripts through ``to_json``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ddplab.adapt import gain
from ddplab.noise import estimators
from ddplab.noise.config import NoiseConfig
from ddplab.serialize import finite


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoiseReport:
    config: NoiseConfig
    """The run, its world size resolved."""
    summary: estimators.Summary
    b_small: int
    """Samples behind each rank's synchronising gradient (per-device batch × accumulation steps)."""
    b_big: int
    """Samples behind the all-reduced gradient: the global batch."""
    history: list[dict[str, float]]
    """One record per measured step: step, g_small_sq, g_big_sq, g2, trace_sigma, b_simple_ema."""
    dataset_size: int | None
    skipped_steps: int = 0
    """Measured steps left out: non-finite gradients (e.g. an fp16 overflow)."""
    weights_moved: bool | None = None
    """Whether training moved the weights (B_simple then averages over the trajectory)."""
    lr: list[float] = dataclasses.field(default_factory=list)
    completed_steps: int
    stopped_early: str | None = None
    """Why the run stopped before its last step (a deadline, a failing rank, a signal); None when it finished."""
    cancelled_by: str | None = None
    """The signal that stopped the run ('SIGINT' for Ctrl-C, 'SIGTERM', 'SIGHUP'); None when none did."""

    @property
    def global_batch_size(self) -> int:
        return self.b_big

    @property
    def steps_factor(self) -> float:
        """Predicted steps relative to the fewest possible at this global batch: 1 + B_simple/B."""
        return self.summary.steps_factor(self.b_big)

    @property
    def adascale_scale(self) -> float:
        """S: the global batch over the per-rank batch AdaScale's gain compares it with."""
        return self.b_big / self.b_small

    @property
    def adascale_gain(self) -> float:
        """AdaScale's gain r = (σ² + μ²)/(σ²/S + μ²), σ² the gradient variance at the per-rank batch."""
        return adascale_gain(self.summary, self.adascale_scale, self.b_small)

    def to_json(self) -> dict[str, Any]:
        summary, cfg = self.summary, self.config
        return finite({
            "b_simple": summary.b_simple, "b_simple_ci95": summary.b_simple_ci95,
            "b_simple_status": summary.status, "note": summary.describe(),
            "critical_batch_size": summary.b_simple, "g2": summary.g2, "trace_sigma": summary.trace_sigma,
            "steps": cfg.steps, "measured_steps": summary.steps, "skipped_steps": self.skipped_steps,
            "every": cfg.every, "strategy": cfg.strategy, "replicate": cfg.replicate, "reduce_dtype": cfg.reduce_dtype,
            "world_size": cfg.world_size, "data_parallel_size": cfg.world_size,
            "per_device_batch_size": cfg.per_device_batch_size,
            "accumulation_steps": cfg.accumulation_steps, "global_batch_size": self.b_big,
            "dataset_size": self.dataset_size, "lr": self.lr, "weights_moved": self.weights_moved,
            "steps_factor": self.steps_factor, "adascale_scale": self.adascale_scale,
            "adascale_gain": self.adascale_gain, "adascale_lr_multiplier": self.adascale_gain, "b_small": self.b_small,
            "per_step": self.history, "completed_steps": self.completed_steps, "stopped_early": self.stopped_early,
            "cancelled_by": self.cancelled_by,
        })


def adascale_gain(summary: estimators.Summary, scale: float, base_batch: float) -> float:
    """AdaScale's gain at S times ``base_batch`` from the window's estimates (σ² = tr Σ / base batch, μ² = |G|²)."""
    return gain.gain(summary.trace_sigma / base_batch, summary.g2, scale)


def from_partial(config: NoiseConfig, partial: dict, stopped_early: str) -> NoiseReport:
    """The report of a run stopped early, from rank 0's last checkpoint and its journal of measured steps."""
    completed = partial["completed_steps"]
    history = [record for record in partial.get("journal", []) if record["step"] < completed]
    if not history:
        raise ValueError("no measured step")
    summary = estimators.summarize([r["g2"] for r in history], [r["trace_sigma"] for r in history])
    fields = {key: partial[key] for key in ("b_small", "b_big", "dataset_size", "skipped_steps", "weights_moved", "lr")}
    return NoiseReport(config=config, summary=summary, history=history, completed_steps=completed,
                       stopped_early=stopped_early, **fields)
