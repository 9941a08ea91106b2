"""The classic nine-run sandbox study, with conclusions checked against the measurements."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

from ddplab.runtime.launch import LaunchConfig
from ddplab.sandbox.config import SandboxConfig, SandboxResult
from ddplab.sandbox.train import resolve, run_multi, train
from ddplab.serialize import finite

WORLD_SIZE, PER_RANK_BATCH = 8, 16


def study_configs(seed: int = 0) -> list[tuple[str, SandboxConfig]]:
    """The nine runs, numbered as in the classic study."""
    def single(batch, noisy=0):
        return SandboxConfig(mode="single", per_device_batch_size=batch, deterministic=not noisy,
                             n_experiments=noisy or 1, seed=seed)

    def multi(lr, noisy=0):
        return SandboxConfig(mode="multi", lr=lr, per_device_batch_size=PER_RANK_BATCH, world_size=WORLD_SIZE,
                             deterministic=not noisy, n_experiments=noisy or 1, seed=seed)

    return [
        ("single B=128, lr 1e-3, deterministic", single(128)),
        ("multi 8×16, lr 1e-3, deterministic", multi(1e-3)),
        ("single B=128, lr 1e-3, noisy ×10,000", single(128, 10_000)),
        ("multi 8×16, lr 1e-3, noisy ×10,000", multi(1e-3, 10_000)),
        ("single B=16, lr 1e-3, deterministic", single(16)),
        ("multi 8×16, lr 8e-3 (linear), deterministic", multi(8e-3)),
        ("single B=16, lr 1e-3, noisy ×1,000", single(16, 1_000)),
        ("multi 8×16, lr 8e-3 (linear), noisy ×1,000", multi(8e-3, 1_000)),
        ("multi 8×16, lr 2.8284e-3 (sqrt), noisy ×1,000", multi(1e-3 * math.sqrt(8), 1_000)),
    ]


@dataclasses.dataclass(frozen=True)
class Conclusion:
    runs: tuple[int, int]
    claim: str
    holds: bool
    evidence: str


@dataclasses.dataclass(frozen=True)
class SandboxTable:
    """The nine runs, numbered as in the classic study, and the claims checked against them."""

    labels: list[str]
    results: list[SandboxResult]
    conclusions: list[Conclusion]
    seconds: float = 0.0
    """Wall time of the nine runs, starting the ranks included."""

    def to_json(self) -> dict:
        return finite({
            "runs": [{"run": i + 1, "label": label, **result.to_json()}
                     for i, (label, result) in enumerate(zip(self.labels, self.results))],
            "conclusions": [dataclasses.asdict(c) for c in self.conclusions],
            "seconds": self.seconds,
        })


def run_table(seed: int = 0, launch_config: LaunchConfig | None = None) -> SandboxTable:
    """Run the nine configurations: every multi run in one launch of the ranks, then the singles."""
    started = time.perf_counter()
    named = [(label, resolve(cfg)) for label, cfg in study_configs(seed)]
    multi_at = [i for i, (_, cfg) in enumerate(named) if cfg.mode == "multi"]
    # Fork the ranks first: the parent must hold no worker threads when it forks.
    multi_results = run_multi([named[i][1] for i in multi_at], launch_config)
    results: list[SandboxResult | None] = [None] * len(named)
    for i, result in zip(multi_at, multi_results):
        results[i] = result
    for i, (_, cfg) in enumerate(named):
        if cfg.mode == "single":
            results[i] = train(cfg)
    return SandboxTable([label for label, _ in named], results, conclude(results), time.perf_counter() - started)


def conclude(r: list[SandboxResult]) -> list[Conclusion]:
    """Check each claim of the study against what was measured."""
    return [
        _check((1, 2), "8 ranks × 16 end at the same w as one process with 128: DDP averages 8 gradients "
                       "of 16 into the gradient of 128", r, _same_w(1e-6)),
        _check((3, 4), "on noisy data too, to float rounding: the 8 shards of each step unite into the "
                       "same 128 samples", r, _same_w_and_variance),
        _check((5, 6), "8× fewer steps at 8× the lr (linear rule) reach the same w", r, _same_w(1e-6)),
        _check((7, 8), "the linear rule keeps where SGD ends up but makes each update ~8× as noisy", r,
               _variance_ratio(8.0, same_w=True)),
        _check((7, 9), "the square-root rule keeps the update variance but falls short of the same w", r,
               _variance_ratio(1.0, same_w=False)),
    ]


Check = Callable[[SandboxResult, SandboxResult], tuple[bool, str]]


def _check(runs: tuple[int, int], claim: str, results: list[SandboxResult], check: Check) -> Conclusion:
    holds, evidence = check(results[runs[0] - 1], results[runs[1] - 1])
    return Conclusion(runs, claim, holds, evidence)


def _same_w(tolerance: float) -> Check:
    def check(a: SandboxResult, b: SandboxResult):
        diff = abs(a.w - b.w)
        return diff <= tolerance, f"|Δw| = {diff:.1e}"
    return check


def _same_w_and_variance(a: SandboxResult, b: SandboxResult):
    dw = abs(a.w - b.w)
    dv = abs(a.update_step_variance - b.update_step_variance) / a.update_step_variance
    return dw <= 1e-6 and dv <= 1e-5, f"|Δw| = {dw:.1e}, relative Δvariance = {dv:.1e}"


def _variance_ratio(expected: float, *, same_w: bool) -> Check:
    def check(a: SandboxResult, b: SandboxResult):
        ratio = b.update_step_variance / a.update_step_variance
        ratio_se = ratio * math.hypot(a.update_step_variance_stderr / a.update_step_variance,
                                      b.update_step_variance_stderr / b.update_step_variance)
        w_gap = b.w - a.w
        w_se = math.hypot(a.w_stderr, b.w_stderr)
        ratio_ok = abs(ratio - expected) <= 4 * ratio_se
        # Same w: within 4 standard errors; short of it: the gap is many standard errors wide.
        w_ok = abs(w_gap) <= 4 * w_se + abs(b.theory().w - a.theory().w) if same_w else w_gap > 4 * w_se
        return ratio_ok and w_ok, f"variance ×{ratio:.2f} ± {ratio_se:.2f}, Δw = {w_gap:+.2e} (± {w_se:.1e})"
    return check
