"""What ``ddplab noise -- COMMAND`` measured: B_simple with its interval, the curve over samples seen, the cost;
for a language model B_simple in tokens too (plans for LMs count tokens per step).

Pure Python: built in the parent from the merged records (:mod:`ddplab.noise.command.merge`), read by the
command line and by scripts through ``to_json``; its ``schedule`` is a batch schedule that
:class:`ddplab.adapt.schedule.BatchSchedule` follows, as it follows ``branched.json``'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ddplab.noise import estimators
from ddplab.noise.command.merge import Merged, StepNorms
from ddplab.serialize import finite


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommandNoiseReport:
    """B_simple of a training command, from the steps its ranks measured."""

    command: tuple[str, ...]
    merged: Merged
    summary: estimators.Summary
    history: list[dict[str, float]]
    """One record per measured step: step, samples_seen, g_small_sq, g_big_sq, g2, trace_sigma."""
    by_samples: list[dict[str, Any]]
    """B_simple over consecutive windows of measured steps, against the samples seen."""
    start_step: int
    every: int | None
    returncode: int
    """The command's own exit code (128 + N when signal N ended it)."""
    stopped_early: str | None = None
    """Why the command stopped before its end (the deadline, a signal, a failure); None when it finished."""
    cancelled_by: str | None = None
    """The signal that stopped the command ('SIGINT' for Ctrl-C); None when none did."""
    failed_after_measuring: str | None = None
    """That the command failed only after the last planned step was measured; None when it did not."""

    @property
    def first(self) -> StepNorms:
        return self.merged.steps[0]

    @property
    def global_batch_size(self) -> int:
        return self.first.b_big

    @property
    def per_device_batch_size(self) -> int:
        # The global batch is the per-device batch × micro-steps × data-parallel ranks, on one rank as on many.
        return self.first.b_big // (max(self.first.forwards, 1) * len(self.merged.group))

    @property
    def overhead(self) -> float | None:
        """The guest's share of a measured step's time."""
        step_s = self.merged.step_s
        return self.merged.guest_s / step_s if step_s else None

    @property
    def tokens_per_sample(self) -> float | None:
        """The mean tokens per sample of the measured steps (the targets their token loss kept); None unless every
        step's every rank called a token loss once per training forward."""
        steps = self.merged.steps
        if not all(step.tokens is not None for step in steps):
            return None
        return sum(step.tokens for step in steps) / sum(step.b_big for step in steps)

    def tokens_json(self) -> dict[str, Any]:
        """B_simple in tokens (B_simple × the mean tokens per sample) with its interval, and how they were counted."""
        per_sample, steps = self.tokens_per_sample, self.merged.steps
        name = next((step.token_loss for step in steps if step.token_loss), None)
        if per_sample is None:
            why = None if name is None else (f"{name} ran over more targets than samples, but not once in each "
                                              "training forward of every measured step on every rank: B_simple is "
                                              "not given in tokens")
            return {"tokens_per_sample": None, "b_simple_tokens": None, "b_simple_tokens_ci95": None,
                    "global_batch_tokens": None, "tokens_note": why}
        interval = self.summary.b_simple_ci95
        tokens, samples = sum(step.tokens for step in steps), sum(step.b_big for step in steps)
        return {"tokens_per_sample": per_sample, "b_simple_tokens": self.summary.b_simple * per_sample,
                "b_simple_tokens_ci95": None if interval is None else [bound * per_sample for bound in interval],
                "global_batch_tokens": self.global_batch_size * per_sample,
                "tokens_note": (f"tokens are the targets {name} kept (not ignore_index) in each training forward: "
                                f"{tokens} over the {samples} samples of {len(steps)} measured steps, "
                                f"{per_sample:.4g} per sample")}

    @property
    def resolved(self) -> list[dict[str, Any]]:
        """The windows whose B_simple has a finite 95% interval: the only ones a decision is taken from."""
        return [point for point in self.by_samples if point["b_simple_status"] == "resolved"]

    def schedule(self) -> list[dict[str, int]]:
        """A batch schedule from the curve: each window's B_simple, rounded down to whole micro-steps, never falling;
        it stops at the first window that is not resolved (:meth:`schedule_note` says where)."""
        micro = self.per_device_batch_size * len(self.merged.group)
        entries: list[dict[str, int]] = []
        for point in self.by_samples[:self._schedule_end()]:
            batch = max(micro, int(point["b_simple"] // micro) * micro)
            if entries and batch <= entries[-1]["global_batch_size"]:
                continue
            entries.append({"samples_seen": 0 if not entries else point["samples_from"], "global_batch_size": batch})
        return entries

    def _schedule_end(self) -> int:
        return next((i for i, point in enumerate(self.by_samples) if point["b_simple_status"] != "resolved"),
                    len(self.by_samples))

    def schedule_note(self) -> str | None:
        """Where the schedule had to stop and why; None when every window is resolved."""
        end = self._schedule_end()
        if end == len(self.by_samples):
            return None
        point = self.by_samples[end]
        where = (f"window {end + 1} of {len(self.by_samples)} (steps {point['steps'][0]}-{point['steps'][1]}, from "
                 f"{point['samples_from']:,} samples seen)")
        if end == 0:
            return f"no schedule: its first {where} is not resolved ({_status_words(point)})"
        return f"the schedule stops before {where}: its B_simple is not resolved ({_status_words(point)})"

    def trend(self) -> dict[str, Any] | None:
        """B_simple at the first and last resolved windows and their ratio; None with fewer than 2 resolved."""
        resolved = self.resolved
        if len(resolved) < 2:
            return None
        first, last = resolved[0], resolved[-1]
        keys = ("samples_seen", "steps", "b_simple", "b_simple_ci95")
        return {"first": {k: first[k] for k in keys}, "last": {k: last[k] for k in keys},
                "ratio": last["b_simple"] / first["b_simple"], "resolved_windows": len(resolved),
                "windows": len(self.by_samples)}

    def trend_note(self) -> str | None:
        """The headline's caveat where B_simple moved over training: which phase to plan with."""
        trend = self.trend()
        if trend is None or 0.5 <= trend["ratio"] <= 2:
            return None
        first, last = trend["first"], trend["last"]
        moved = "grew" if trend["ratio"] > 1 else "fell"
        return (f"B_simple {moved} {trend['ratio']:.3g}× over training, from {_point_words(first)} to "
                f"{_point_words(last)} ({trend['resolved_windows']} of {trend['windows']} windows resolved): the "
                "run's one ratio above mixes the phases; plan --from-noise takes the last resolved window")

    def to_json(self) -> dict[str, Any]:
        summary, merged = self.summary, self.merged
        steps = [r["step"] for r in self.history]
        return finite({
            "b_simple": summary.b_simple, "b_simple_ci95": summary.b_simple_ci95, "b_simple_status": summary.status,
            "note": summary.describe(), "critical_batch_size": summary.b_simple, "g2": summary.g2,
            "trace_sigma": summary.trace_sigma, "command": list(self.command), "strategy": merged.strategy,
            "world_size": merged.world_size, "data_parallel_size": len(merged.group),
            "per_device_batch_size": self.per_device_batch_size, "accumulation_steps": self.first.forwards,
            "global_batch_size": self.global_batch_size, "b_small": self.first.b_small,
            "dataset_size": self.first.dataset_size, "start_step": self.start_step, "every": self.every,
            "measured_steps": summary.steps, "measured_step_range": [min(steps), max(steps)],
            "left_out": merged.left_out, "guest_notes": merged.notes, "optimizer_steps": merged.optimizer_steps,
            "steps_factor": summary.steps_factor(self.global_batch_size),
            "guest_seconds_per_measured_step": merged.guest_s, "measured_step_seconds": merged.step_s,
            "overhead": self.overhead, "per_step": self.history, "by_samples": self.by_samples,
            "schedule": self.schedule(), "schedule_note": self.schedule_note(), "trend": self.trend(),
            "trend_note": self.trend_note(), "returncode": self.returncode, "stopped_early": self.stopped_early,
            "cancelled_by": self.cancelled_by, "failed_after_measuring": self.failed_after_measuring,
            **self.tokens_json(),
        })


def _status_words(point: dict[str, Any]) -> str:
    interval = point["b_simple_ci95"]
    if point["b_simple_status"] == "g2_unresolved" and interval is not None:
        return f"|G|² within its error of 0: B_simple > {interval[0]:.4g} at 95%"
    return point["b_simple_status"].replace("_", " ")


def _point_words(point: dict[str, Any]) -> str:
    low, high = point["b_simple_ci95"]
    return f"{point['b_simple']:.4g} [{low:.4g}, {high:.4g}] at {point['samples_seen']:,.0f} samples"


def build(command: tuple[str, ...], merged: Merged, *, start_step: int, every: int | None, window: int,
          returncode: int, stopped_early: str | None = None, cancelled_by: str | None = None,
          failed_after_measuring: str | None = None) -> CommandNoiseReport:
    """The report of the merged steps; ValueError when no step was measured."""
    if not merged.steps:
        raise ValueError("no measured step")
    history = [_estimate(step) for step in merged.steps]
    summary = estimators.summarize([r["g2"] for r in history], [r["trace_sigma"] for r in history])
    return CommandNoiseReport(command=command, merged=merged, summary=summary, history=history,
                              by_samples=by_samples(history, window), start_step=start_step, every=every,
                              returncode=returncode, stopped_early=stopped_early, cancelled_by=cancelled_by,
                              failed_after_measuring=failed_after_measuring)


def _estimate(step: StepNorms) -> dict[str, float]:
    g2, trace = estimators.unbiased_estimates(step.g_small_sq, step.g_big_sq, step.b_small, step.b_big,
                                              step.dataset_size)
    # Samples before this step, at the measured step's global batch.
    return {"step": step.step, "samples_seen": step.step * step.b_big, "g_small_sq": step.g_small_sq,
            "g_big_sq": step.g_big_sq, "g2": g2, "trace_sigma": trace}


def by_samples(history: list[dict[str, float]], window: int) -> list[dict[str, Any]]:
    """B_simple with its interval over each run of ``window`` measured steps (a short last run joins the one before)."""
    cuts = list(range(0, len(history), window))
    if len(cuts) > 1 and len(history) - cuts[-1] < window // 2:
        cuts.pop()
    points = []
    for begin, end in zip(cuts, [*cuts[1:], len(history)]):
        part = history[begin:end]
        summary = estimators.summarize([r["g2"] for r in part], [r["trace_sigma"] for r in part])
        points.append({"samples_seen": sum(r["samples_seen"] for r in part) / len(part),
                       "samples_from": part[0]["samples_seen"], "samples_to": part[-1]["samples_seen"],
                       "steps": [part[0]["step"], part[-1]["step"]], "b_simple": summary.b_simple,
                       "b_simple_ci95": summary.b_simple_ci95, "b_simple_status": summary.status})
    return points
