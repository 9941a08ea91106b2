"""``schedule``: ``ddplab.BatchSchedule`` following a batch schedule from scratch, one run per seed.

The schedule is ``StudyConfig.schedule``: a ``branched.json`` (what ``--branch-at/--branch-from``
writes), a ``schedule.json`` list of ``{"samples_seen", "global_batch_size", "lr"}`` entries, or a
Megatron-style ``"0:32 416:64"`` string. Each seed's run starts at the schedule's first global batch
(a batch of the grid) from the grid's initial weights for that seed, and trains as the ramp does
(:mod:`ddplab.study.rules.changing`) with the batch and lr the schedule sets, without a warmup. Like
the ramp's, each run starts at the best tuned lr at its first batch (else the linear rule's), the fixed
run it is judged against; each later entry trains at its own lr, the best the branches measured at that
batch from the training's state there; a schedule without lrs (a Megatron string) keeps the start lr
throughout. (Scaling the later lrs by the first's ratio instead would carry a reference lr that was not
the tuned one into every later phase: from lr 0.01 on charlm, 2-6× the tuned lr at the larger batches.)
Not fitted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from typing import TYPE_CHECKING

from ddplab.adapt import thresholds as th
from ddplab.errors import UsageError
from ddplab.study.fit import median
from ddplab.study.rules import changing, phases
from ddplab.study.rules.base import BatchRuns, html_num
from ddplab.study.rules.registry import register

if TYPE_CHECKING:
    from ddplab.study.config import StudyConfig


class Schedule(changing.ChangingRule):
    name = "schedule"
    summary = "ddplab.BatchSchedule following {schedule} from scratch, from its first global batch"
    help = "schedule adds one BatchSchedule run per seed following ``schedule``"
    colour = "crimson"

    def check(self, config: StudyConfig) -> None:
        if config.schedule is None:
            raise UsageError("the schedule rule follows {schedule}: give a branched.json, a schedule.json or a "
                             "Megatron-style string such as '0:32 416:64'")
        first = thresholds(config)[0].global_batch_size
        if first not in config.global_batch_sizes:
            raise UsageError(f"{{schedule}} starts at global batch {first}, which {{global_batch_sizes}} does not "
                             "hold: add it, as the schedule is judged against the tuned runs there")

    def start(self, config: StudyConfig) -> int | None:
        """The global batch schedule runs start from (the schedule's first), or None without the rule."""
        return thresholds(config)[0].global_batch_size if self.name in config.rules else None

    def cache_tag(self, config: StudyConfig) -> str:
        return digest(config)

    def micro_batch_size(self, config: StudyConfig) -> int:
        # Micro-batches that divide every entry's global batch.
        return math.gcd(*(t.global_batch_size for t in thresholds(config)))

    def adapter(self, workload, config: StudyConfig, model, optimizer):
        """The library's BatchSchedule following the schedule from the run's lr (no warmup, nothing before a step)."""
        from ddplab.adapt.schedule import BatchSchedule

        micro = self.micro_batch_size(config)
        entries = [{"samples_seen": t.samples_seen, "global_batch_size": t.global_batch_size, "lr": t.lr}
                   for t in as_run(thresholds(config), optimizer.param_groups[0]["lr"])]
        return BatchSchedule(model, optimizer, entries, per_device_batch_size=micro), lambda: None

    def report(self, config: StudyConfig, batches: dict[int, BatchRuns], tuned: list[dict]) -> dict:
        """Median steps and samples of the schedule's runs beside the best-tuned fixed lr's at its first batch."""
        start = self.start(config)
        runs = self.seeds_at(batches[start]) if start in batches else None
        if not runs:
            return {}
        return {"adaptive": {self.name: changing.adaptive(start, runs, tuned)},
                "schedule_accounting": accounting(config, batches, runs)}

    def text(self, values: dict) -> list[str]:
        return super().text(values) + accounting_text(values.get("schedule_accounting"))

    def html(self, values: dict) -> str:
        """The accounting as a table: a row per phase."""
        accounting = values.get("schedule_accounting")
        if not accounting or not accounting["phases"]:
            return ""
        rows = "".join(
            f"<tr><td>{r['global_batch_size']}</td><td>{html_num(r['lr'])}</td><td>{r['steps']}</td>"
            f"<td>{r['start_samples']} to {r['end_samples']}</td><td>{html_num(r['metric'])}</td>"
            f"<td>{html_num(r['fixed_metric'])}</td><td>{html_num(r['samples_ratio'])}"
            + (f" ({html_num(r['samples_ratio_range'][0])} to {html_num(r['samples_ratio_range'][1])})"
               if r["samples_ratio_range"] else "") + "</td></tr>" for r in accounting["phases"])
        lines = accounting_text(accounting)
        return (f"<h2>The schedule phase by phase</h2><p>{lines[0]} Each phase's metric at its end (a switch, or the "
                "target), the fixed run's after the same samples, and the schedule's samples over those the fixed run "
                "took to that metric (median over seeds, their range in brackets).</p><table><tr><th>global batch"
                "</th><th>lr</th><th>steps</th><th>samples</th><th>metric at its end</th><th>fixed run's</th>"
                f"<th>samples ratio</th></tr>{rows}</table>")

    def figures(self, values: dict, directory: str, drawing) -> list[str]:
        accounting = values.get("schedule_accounting")
        if not accounting or not accounting["curves"]["fixed"]:
            return []
        return [schedule_plot(accounting, values["target"], directory, drawing)]


def accounting(config: StudyConfig, batches: dict[int, BatchRuns], runs: list) -> dict:
    """The schedule's runs phase by phase against the best tuned fixed run at its first batch on the same seeds
    (:mod:`ddplab.study.rules.phases`), and the curves the figure draws: each seed's metric by samples seen, for the
    schedule and for the best tuned fixed lr at each batch the schedule reaches."""
    steps = thresholds(config)
    higher = config.target.kind == "accuracy"
    curve = [[[phases.samples_after(steps, h[0]), h[2]] for h in run.history] for run in runs]
    fixed = {}
    for batch in sorted({t.global_batch_size for t in steps}):
        view = batches.get(batch)
        if view is not None and view.best is not None:
            found = view.seeds_at(view.best.lr, view.best.variant)
            fixed[batch] = {"lr": view.best.lr, "seeds": [[[h[0] * batch, h[2]] for h in r.history] for r in found]}
    start = steps[0].global_batch_size
    rows = phases.account(as_run(steps, runs[0].lr), runs[0].lr, [(len_steps(run), c) for run, c in zip(runs, curve)],
                          fixed[start]["seeds"], higher, config.target.value) if start in fixed else []
    return {"start_global_batch_size": start, "fixed_lr": fixed[start]["lr"] if start in fixed else None,
            "phases": rows, "curves": {"schedule": curve, "fixed": fixed}}


def len_steps(run) -> int:
    """The steps a run trained: to its target, else to its last evaluation."""
    return run.steps_to_target or (run.history[-1][0] if run.history else 0)


def accounting_text(accounting: dict | None) -> list[str]:
    """One line per phase: where the samples went, against the fixed run on the same seeds."""
    if not accounting or not accounting["phases"]:
        return []
    rows = accounting["phases"]
    lines = [f"schedule phase by phase (median over {rows[0]['seeds']} seeds), against the best tuned fixed lr "
             f"{accounting['fixed_lr']:.4g} at global batch {accounting['start_global_batch_size']} on the same seeds:"]
    for i, row in enumerate(rows):
        end = "at the target" if i == len(rows) - 1 else "at the switch"
        ratio = "" if row["samples_ratio"] is None else (
            f"; {row['samples_ratio']:.2f}× the samples the fixed run took to that metric (seeds "
            f"{row['samples_ratio_range'][0]:.2f} to {row['samples_ratio_range'][1]:.2f})")
        lines.append(f"  global batch {row['global_batch_size']} at lr {row['lr']:.4g}: {row['steps']} steps, samples "
                     f"{row['start_samples']} to {row['end_samples']}; {end} {_num(row['metric'])} vs the fixed "
                     f"run's {_num(row['fixed_metric'])}{ratio}")
    return lines


def schedule_plot(accounting: dict, target: dict, directory: str, drawing) -> str:
    """schedule.png: the metric against samples seen, the median over seeds with their range, for the best tuned fixed
    lr at each batch the schedule reaches and for the schedule, its switches marked."""
    path = os.path.join(directory, "schedule.png")
    plt = drawing.pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    cmap = plt.get_cmap("viridis")
    fixed = accounting["curves"]["fixed"]
    for i, (batch, entry) in enumerate(sorted(fixed.items(), key=lambda kv: int(kv[0]))):
        _band(ax, entry["seeds"], cmap(i / max(1, len(fixed) - 1)), f"fixed global batch {batch}, lr {entry['lr']:.3g}")
    _band(ax, accounting["curves"]["schedule"], "crimson", "the schedule", width=2.2)
    for row in accounting["phases"][1:]:
        ax.axvline(row["start_samples"], color="crimson", linestyle="--", alpha=0.5)
        ax.annotate(f"→ {row['global_batch_size']}", (row["start_samples"], 1.0), xycoords=("data", "axes fraction"),
                    textcoords="offset points", xytext=(3, -12), fontsize=8, color="crimson")
    ax.axhline(target["value"], color="black", linestyle=":", label="target")
    ax.set_xlabel("samples seen")
    ax.set_ylabel(f"validation {target['kind']}")
    ax.set_title("the schedule against fixed batches, by samples (median over seeds, band: their range)")
    drawing.save_figure(plt, fig, path, [ax])
    return path


def _band(ax, seeds: list, colour, label: str, width: float = 1.4) -> None:
    # Evaluations fall at the same samples on every seed: the median and range at each.
    by_samples: dict[float, list[float]] = {}
    for curve in seeds:
        for samples, metric in curve:
            by_samples.setdefault(samples, []).append(metric)
    xs = sorted(by_samples)
    if not xs:
        return
    ax.plot(xs, [median(by_samples[x]) for x in xs], color=colour, linewidth=width, label=label)
    ax.fill_between(xs, [min(by_samples[x]) for x in xs], [max(by_samples[x]) for x in xs], color=colour, alpha=0.15)


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:.4g}"


def thresholds(config: StudyConfig) -> tuple[th.Threshold, ...]:
    return th.parse(config.schedule)


def as_run(entries: tuple[th.Threshold, ...], start_lr: float) -> tuple[th.Threshold, ...]:
    """The entries a run follows: the first at the run's own lr (the tuned one), each later one at the lr the
    branches measured there, as written; a schedule without lrs keeps the run's lr throughout.

    >>> [t.lr for t in as_run(th.parse([{"samples_seen": 0, "global_batch_size": 8, "lr": 0.01},
    ...                                  {"samples_seen": 64, "global_batch_size": 16, "lr": 0.04}]), 0.02)]
    [0.02, 0.04]
    """
    if entries[0].lr is None:
        return entries
    return (dataclasses.replace(entries[0], lr=start_lr), *entries[1:])


def digest(config: StudyConfig) -> str:
    """A short hash of the schedule's entries: its runs are cached apart from another schedule's."""
    # "own-lrs": later entries train at their own lrs (runs cached before, at the first's ratios, are not these).
    text = "own-lrs;" + ";".join(f"{t.samples_seen}:{t.global_batch_size}:{t.lr!r}" for t in thresholds(config))
    return "-" + hashlib.sha256(text.encode()).hexdigest()[:8]


register(Schedule())
