"""A batch schedule's run accounted phase by phase against the fixed run it is judged by (torch-free).

A schedule's run is deterministic in its batches: after each optimizer step the entry in force is the last
whose threshold the samples seen have reached (``BatchSchedule``). So the steps and samples spent at each batch
follow from the thresholds and the run's step count alone. At each switch the run's metric is read against the
fixed run's on the same seed (the same initial weights and the same sample order), by samples seen:

- ``fixed_metric``: where the fixed run was after the same samples;
- ``samples_ratio``: the schedule's samples over the samples the fixed run needed to reach the schedule's metric
  there. Above 1 the schedule is behind on the small batch's loss-vs-samples curve; at the target it is the
  samples ratio the study reports.

The evaluations are every few steps, so both runs' metrics are read between evaluations linearly by samples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ddplab.adapt import thresholds as th
from ddplab.study.fit import median


@dataclasses.dataclass(frozen=True)
class Phase:
    """The steps a schedule's run trained at one of its entries."""

    global_batch_size: int
    lr_factor: float
    """The entry's lr over the first entry's (the run's lr is its start lr × this)."""
    start_samples: int
    """Samples seen when the phase began."""
    steps: int

    @property
    def end_samples(self) -> int:
        return self.start_samples + self.steps * self.global_batch_size


def phases(thresholds: Sequence[th.Threshold], steps: int) -> list[Phase]:
    """The phases of ``steps`` optimizer steps that follow ``thresholds``.

    >>> [(p.global_batch_size, p.start_samples, p.steps) for p in phases(th.parse("0:32 100:64 300:128"), 8)]
    [(32, 0, 4), (64, 128, 3), (128, 320, 1)]
    """
    factors = th.lr_factors(thresholds)
    out: list[Phase] = []
    samples = 0
    for _ in range(steps):
        entry = th.index_at(thresholds, samples)
        batch = thresholds[entry].global_batch_size
        if not out or out[-1].global_batch_size != batch or out[-1].lr_factor != factors[entry]:
            out.append(Phase(batch, factors[entry], samples, 0))
        out[-1] = dataclasses.replace(out[-1], steps=out[-1].steps + 1)
        samples += batch
    return out


def samples_after(thresholds: Sequence[th.Threshold], steps: int) -> int:
    """Samples seen after ``steps`` steps of the schedule.

    >>> samples_after(th.parse("0:32 100:64"), 5)  # four steps of 32 reach 128, then one of 64
    192
    """
    found = phases(thresholds, steps)
    return found[-1].end_samples if found else 0


Curve = Sequence[tuple[float, float]]
"""(samples seen, metric) at each evaluation, in order."""


def metric_at(curve: Curve, samples: float) -> float | None:
    """The metric after ``samples``, linear between evaluations; None outside the evaluated range.

    >>> metric_at([(100, 2.0), (200, 1.0)], 150), metric_at([(100, 2.0)], 300)
    (1.5, None)
    """
    for (s0, m0), (s1, m1) in zip(curve, curve[1:]):
        if s0 <= samples <= s1:
            return m0 + (m1 - m0) * (samples - s0) / (s1 - s0) if s1 > s0 else m1
    if curve and curve[-1][0] == samples:
        return curve[-1][1]
    return None


def samples_to(curve: Curve, metric: float, higher_is_better: bool) -> float | None:
    """The samples at which the curve's best so far first reaches ``metric``, linear between evaluations; None when it
    never does.

    >>> samples_to([(100, 3.0), (200, 2.0), (300, 2.5)], 2.5, False), samples_to([(100, 3.0)], 2.0, False)
    (150.0, None)
    """
    sign = 1.0 if higher_is_better else -1.0
    before: tuple[float, float] | None = None
    # The envelope of the best so far, linear from the evaluation before to the one that reaches the metric.
    for samples, value in curve:
        if sign * value >= sign * metric:
            if before is None:
                return float(samples)
            s0, m0 = before
            return s0 + (samples - s0) * (sign * metric - m0) / (sign * value - m0)
        best = sign * value if before is None else max(before[1], sign * value)
        before = (float(samples), best)
    return None


@dataclasses.dataclass(frozen=True)
class Switch:
    """One seed's run against the fixed run where a phase ended (a switch, or the run's end)."""

    samples: int
    metric: float | None
    fixed_metric: float | None
    samples_ratio: float | None


def switches(found: list[Phase], run: Curve, fixed: Curve, higher_is_better: bool, target: float) -> list[Switch]:
    """At the end of each phase: both runs' metrics after the same samples, and the samples ratio (the module's
    docstring). A metric past the target is read as the target: both runs stop there, so at the end the ratio is
    the two runs' samples to the target."""
    out = []
    sign = 1.0 if higher_is_better else -1.0
    for phase in found:
        end = phase.end_samples
        metric = metric_at(run, end)
        goal = target if metric is not None and sign * metric > sign * target else metric
        reached = samples_to(fixed, goal, higher_is_better) if goal is not None else None
        out.append(Switch(end, metric, metric_at(fixed, end), end / reached if reached else None))
    return out


def account(thresholds: Sequence[th.Threshold], start_lr: float, runs: Sequence[tuple[int, Curve]],
            fixed: Sequence[Curve], higher_is_better: bool, target: float) -> list[dict]:
    """Each phase of the schedule, over the seeds: its batch, lr, steps and samples (of the median seed's run, by
    steps), and at its end the median over seeds of both metrics and of the samples ratio, with the ratio's range.

    ``runs``: each seed's (steps trained, curve); ``fixed``: the fixed run's curve on the same seeds.
    """
    steps = [s for s, _ in runs]
    middle = sorted(steps)[(len(steps) - 1) // 2]
    per_seed = [switches(phases(thresholds, s), curve, base, higher_is_better, target)
                for (s, curve), base in zip(runs, fixed)]
    rows = []
    for i, phase in enumerate(phases(thresholds, middle)):
        at = [seed[i] for seed in per_seed if i < len(seed)]
        ratios = [a.samples_ratio for a in at if a.samples_ratio is not None]
        rows.append({"global_batch_size": phase.global_batch_size, "lr": start_lr * phase.lr_factor,
                     "start_samples": phase.start_samples, "end_samples": phase.end_samples, "steps": phase.steps,
                     "samples": phase.steps * phase.global_batch_size,
                     "metric": _median(a.metric for a in at), "fixed_metric": _median(a.fixed_metric for a in at),
                     "samples_ratio": median(ratios) if ratios else None,
                     "samples_ratio_range": [min(ratios), max(ratios)] if ratios else None, "seeds": len(at)})
    return rows


def _median(values) -> float | None:
    found = [v for v in values if v is not None]
    return median(found) if found else None
