"""The grid's figures (PNG, matplotlib): steps and samples per rule, the lrs, B_simple, the ramp, AdaScale."""

from __future__ import annotations

import math
import os
import sys

from ddplab.study.report.records import TRAINING_LOSS
from ddplab.study.rules import registry

SPARE = ("tab:pink", "gold", "navy", "black")


ADAPTIVE_MARKERS = ("*", "P", "X", "D")
"""The markers of the rules whose batch changes on the Pareto plot, in the order the study reports them."""


def color(rule: str) -> str:
    """A rule's colour in every plot (a rule registered later takes a spare one, the same in every figure)."""
    own = registry.get(rule).colour if rule in registry.known() else None
    if own is not None:
        return own
    return SPARE[list(registry.known()).index(rule) % len(SPARE)] if rule in registry.known() else SPARE[-1]


def _truth_colour() -> str:
    """The ground truth's colour (the tuned sweep's): its fit, its best lrs, its runs' batch."""
    return color(registry.ground_truth().name)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plots(report: dict, results: dict, directory: str, compare: dict | None = None) -> list[str]:
    """Write the three plots under ``directory``; returns their paths."""
    os.makedirs(directory, exist_ok=True)
    drawn = [("steps_vs_batch.png", lambda path: _steps_plot(report, path)),
             ("loss_curves.png", lambda path: _curves_plot(report, results, path)),
             ("pareto.png", lambda path: _pareto_plot(report, path))]
    if report["tuned_lr"]:
        # The best lrs are the tuned sweep's: a study without one has none to draw.
        drawn.insert(1, ("tuned_lr.png", lambda path: _lr_plot(report, path)))
    paths = []
    for name, draw in drawn:
        paths.append(os.path.join(directory, name))
        draw(paths[-1])
    if compare is not None:
        paths.append(os.path.join(directory, "compare_lr.png"))
        _compare_plot(report, compare, paths[-1])
    if (report.get("b_simple") or {}).get("by_batch"):
        paths.append(os.path.join(directory, "b_simple.png"))
        _b_simple_plot(report, paths[-1])
    for rule in registry.known().values():
        paths += rule.figures(report, directory, sys.modules[__name__])
    return paths


def batch_axes(axis, ylabel: str, title: str | None = None, xlabel: str = "global batch size B") -> None:
    """Log₂ global batch across, a log y up: the axes of every per-batch plot."""
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    if title is not None:
        axis.set_title(title)


def save_figure(plt, fig, path: str, axes) -> None:
    """Grid and legend on each axis (a log axis labelled in plain numbers), then the PNG, and the figure freed."""
    for axis in axes:
        axis.grid(True, which="both", alpha=0.3)
        if axis.get_xscale() == "log" or axis.get_yscale() == "log":
            _plain_log_labels(axis)
        legend(axis, fontsize=8)
    write_figure(plt, fig, path)


def legend(axis, **options) -> None:
    """The axis's legend, where something drawn has a label (else none, and no warning of matplotlib's)."""
    if axis.get_legend_handles_labels()[0]:
        axis.legend(**options)


def write_figure(plt, fig, path: str) -> None:
    """The PNG, laid out, and the figure freed."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _steps_plot(report: dict, path: str) -> None:
    plt = pyplot()
    fig, (ax, ax_e) = plt.subplots(1, 2, figsize=(12, 6.4))
    batches = report["global_batch_sizes"]
    for rule in report["rules"]:
        points = _median_points(report, rule)
        if not points:
            # A rule that diverged or never arrived still has its line in the legend, saying so.
            ax.plot([], [], "o-", color=color(rule), label=f"{rule}: median never reached at two batches")
            continue
        lows, highs = _seed_bars(report, rule, points)
        ax.errorbar(*zip(*points), yerr=(lows, highs), fmt="o-", color=color(rule), capsize=3,
                    label=f"{rule} (bars: fastest to slowest seed)")
        ax_e.plot([b for b, _ in points], [b * s for b, s in points], "o-", color=color(rule), label=rule)
        fit = report["fit"].get(rule)
        if fit and fit["b_crit"] is not None and fit["s_min"]:
            grid = [batches[0] * (batches[-1] / batches[0]) ** (i / 100) for i in range(101)]
            ax.plot(grid, [fit["s_min"] * (1 + fit["b_crit"] / b) for b in grid], "--", color=color(rule),
                    linewidth=1, label=f"{rule} fit: " + ("flat, B_crit undefined" if fit.get("undefined") else
                                                          f"B_crit {fit['b_crit']:.3g}"))
            band = sorted((int(b), v) for b, v in (fit.get("band") or {}).items() if None not in v)
            if band:
                ax.fill_between([b for b, _ in band], [v[0] for _, v in band], [v[1] for _, v in band],
                                color=color(rule), alpha=0.12, linewidth=0,
                                label=f"{rule} fit's 95% band (seeds resampled)")
    tuned = report["fit"].get(registry.ground_truth().name)
    if tuned and tuned["b_crit"] is not None:
        _regimes(ax, tuned, batches)
    if report.get("b_simple") and report["b_simple"]["value"]:
        ax.axvline(report["b_simple"]["value"], color="tab:purple", linestyle=":",
                   label=f"B_simple {report['b_simple']['value']:.3g}")
    for axis, label in ((ax, "optimizer steps to target (median over seeds)"), (ax_e, "samples to target S·B")):
        batch_axes(axis, label)
        _plain_log_labels(axis)  # 8, 16 and 400, not 2³ and 4×10²
        axis.grid(True, which="both", alpha=0.3)
    target = report["target"]
    ax.set_title(f"{report['workload']}: steps to {target['kind']} {target['value']:g}")
    ax_e.set_title("compute side: E = S·B")
    # Below the axes: inside, a legend of every rule and fit covers the small batches' points.
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)
    legend(ax_e, fontsize=7, loc="upper left")
    write_figure(plt, fig, path)


def _seed_bars(report: dict, rule: str, points: list[tuple[int, float]]) -> tuple[list[float], list[float]]:
    """Error bars from the median down to the fastest seed and up to the slowest (capped where a seed never
    arrived)."""
    ranges = report["fit"][rule].get("seed_range", {})
    lows, highs = [], []
    for b, median in points:
        low, high = ranges.get(str(b), [median, median])
        lows.append(median - (low if low is not None else median))
        highs.append((high if high is not None else report["max_steps"]) - median)
    return lows, highs


def _compare_plot(report: dict, other: dict, path: str) -> None:
    """Two studies' best lr per batch side by side (say SGD and AdamW), each beside its own rule's prediction from
    its reference: linear for SGD, square root for Adam (Malladi et al. 2022)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.8))
    for study, color in ((report, "tab:green"), (other, "tab:purple")):
        name = f"{study['optimizer'].get('name', '?')} ({study.get('workload', '?')})"
        points = [(p["global_batch_size"], p["lr"]) for p in study["tuned_lr"] if p.get("lr")]
        if points:
            ax.plot(*zip(*points), "o-", color=color, label=f"{name}: best tuned lr")
        ref = study["reference"]
        rule = registry.predicting(study["optimizer"].get("family", "sgd"))
        batches = sorted(study.get("global_batch_sizes") or [b for b, _ in points])
        if batches:
            ax.plot(batches, [scale_lr(ref) * rule.factor(b / ref["global_batch_size"]) for b in batches], "--",
                    color=color, alpha=0.7, label=f"{name}: {rule.name} rule from its reference")
    batch_axes(ax, "learning rate", "best lr per batch: this study and the one compared")
    save_figure(plt, fig, path, (ax,))


def _b_simple_plot(report: dict, path: str) -> None:
    """B_simple per batch size along the best tuned runs (95% interval), its early, middle and late thirds, the
    pooled value and B_crit: the noise scale grows as training goes, and B_crit is judged against it."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.8))
    b_simple = report["b_simple"]
    # A log axis: a stretch whose |G|² was not resolved (no positive B_simple) is left out.
    rows = [r for r in b_simple["by_batch"] if r.get("value") and r["value"] > 0]
    for row in rows:
        low, high = (row.get("ci95") or [None, None])
        value = row["value"]
        ax.errorbar([row["global_batch_size"]], [value],
                    yerr=[[value - low if low else 0], [high - value if high is not None else 0]],
                    fmt="o", color="tab:purple", capsize=3)
    for stage, marker, name in ((0, "v", "first third"), (1, "s", "middle third"), (2, "^", "last third")):
        points = [(r["global_batch_size"], r["by_progress"][stage]) for r in b_simple["by_batch"]
                  if r["by_progress"][stage] and r["by_progress"][stage] > 0]
        if points:
            ax.plot(*zip(*points), marker, color="gray", alpha=0.6, label=f"{name} of each run")
    ax.plot([], [], "o", color="tab:purple", label="whole runs (95% interval)")
    if b_simple.get("value"):
        ax.axhline(b_simple["value"], color="tab:purple", linestyle=":", label=f"pooled {b_simple['value']:.3g}")
    tuned = report["fit"].get(registry.ground_truth().name)
    if tuned and tuned.get("b_crit"):
        ax.axhline(tuned["b_crit"], color=_truth_colour(), linestyle="--", label=f"B_crit {tuned['b_crit']:.3g}")
    batch_axes(ax, "B_simple = tr Σ / |G|²", "the gradient noise scale along the best runs",
                xlabel="global batch size B (the best tuned runs at it)")
    save_figure(plt, fig, path, (ax,))


def _pareto_plot(report: dict, path: str) -> None:
    """Steps against samples for the tuned curve, with the fitted Pareto front (S/S_min − 1)(E/E_min − 1) = 1
    (McCandlish et al. 2018, fig. 7a)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.8))
    if not any(_median_points(report, rule) for rule in report["rules"]):
        ax.text(0.5, 0.5, "no rule's median run reached the target at two batch sizes", ha="center",
                transform=ax.transAxes)
        write_figure(plt, fig, path)
        return
    shown = []  # (samples, steps) of everything drawn: the axes hold them, not the fitted curve's far ends
    labels = []  # (samples, steps, global batch) of each rule's median points
    for rule in report["rules"]:
        points = _median_points(report, rule)
        if points:
            ax.plot([b * s for b, s in points], [s for _, s in points], "o", color=color(rule), label=rule)
            labels += [(b * s, s, b) for b, s in points]
            shown += [(b * s, s) for b, s in points]
    fit = report["fit"].get(registry.ground_truth().name)
    if fit and fit["b_crit"] is not None and fit["s_min"] and fit["e_min"]:
        s_min, e_min = fit["s_min"], fit["e_min"]
        # x = E/E_min − 1 over three decades: S = S_min(1 + 1/x), E = E_min(1 + x).
        xs = [10 ** (-2 + 4 * i / 200) for i in range(201)]
        ax.plot([e_min * (1 + x) for x in xs], [s_min * (1 + 1 / x) for x in xs], "--", color=_truth_colour(),
                label="tuned fit: (S/S_min − 1)(E/E_min − 1) = 1")
        ax.axhline(s_min, color="gray", linestyle=":", label=f"S_min {s_min:.3g}")
        ax.axvline(e_min, color="gray", linestyle="-.", label=f"E_min {e_min:.3g}")
        shown.append((e_min, s_min))
    shown += _adaptive_points(ax, report)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(min(x for x, _ in shown) / 1.4, max(x for x, _ in shown) * 1.6)
    ax.set_ylim(min(y for _, y in shown) / 1.25, max(y for _, y in shown) * 1.8)
    _plain_log_labels(ax)
    ax.set_xlabel("samples to target E = S·B (median steps × batch)")
    ax.set_ylabel("optimizer steps to target S")
    ax.set_title("steps vs samples: the Pareto front (labels: global batch)")
    ax.grid(True, which="both", alpha=0.3)
    # Beside the axes: the points crowd the front's bend, where a legend inside would cover them.
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
    # At each batch the point with the fewest steps (the best rule there) is labelled first.
    _batch_labels(ax, sorted(labels, key=lambda label: (label[2], label[1])), shown)
    write_figure(plt, fig, path)


def _batch_labels(ax, labels: list[tuple[float, float, int]], points: list[tuple[float, float]]) -> None:
    """Each point's global batch beside it, on the first side where it covers no label and no point already there;
    a label with no free side is left out (rules' points of one batch sit close: the first in ``labels`` wins)."""
    from matplotlib.transforms import Bbox

    # Tried in order: above right, below right, above left, below left (offset in points, alignment).
    sides = ((4, 3, "left", "bottom"), (4, -3, "left", "top"), (-4, 3, "right", "bottom"), (-4, -3, "right", "top"))
    ax.figure.tight_layout()  # the final layout, so what overlaps is what the PNG shows
    renderer = ax.figure.canvas.get_renderer()
    pad = 3.5 * ax.figure.dpi / 72  # a marker's radius (3 points) and a little, in pixels
    taken = [Bbox.from_extents(x - pad, y - pad, x + pad, y + pad) for x, y in ax.transData.transform(points)]
    said = []  # (batch, pixel position) of each label placed
    for x, y, batch in labels:
        where = ax.transData.transform((x, y))
        # Rules that agree at a batch draw one point: it needs one label.
        if any(b == batch and abs(where - at).max() < 2 * pad for b, at in said):
            continue
        said.append((batch, where))
        for dx, dy, ha, va in sides:
            text = ax.annotate(str(batch), (x, y), fontsize=7, xytext=(dx, dy), textcoords="offset points", ha=ha,
                               va=va)
            box = text.get_window_extent(renderer)
            if not any(box.overlaps(other) for other in taken):
                taken.append(box)
                break
            text.remove()


def _plain_log_labels(ax) -> None:
    """Log axes labelled in plain numbers (2000, 5000, 10000), minor ticks at 2× and 5× only where an axis spans
    under two decades: there matplotlib's default crowds 3×10³ into 4×10³."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    def minor(value: float, _) -> str:
        return f"{value:g}" if f"{value:.0e}"[0] in "25" else ""

    for axis, (low, high) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
        axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axis.set_minor_formatter(FuncFormatter(minor) if high < 100 * low else NullFormatter())


def _adaptive_points(ax, report: dict) -> list[tuple[float, float]]:
    """Each rule whose batch changes at its median (samples, steps), a marker of its own, its bars the range of its
    seeds that reached the target; returns the corners drawn."""
    corners = []
    for i, (name, entry) in enumerate((report.get("adaptive") or {}).items()):
        steps, samples = entry["median_steps"], entry["median_samples"]
        if steps is None or samples is None:
            continue
        (fewest_steps, most_steps), (fewest_samples, most_samples) = seed_ranges(report["runs"], name)
        beaten = entry.get("dominated_by")
        verdict = f"dominated by batch {', '.join(map(str, beaten))}" if beaten else "no fixed batch has fewer of both"
        marker = ADAPTIVE_MARKERS[i % len(ADAPTIVE_MARKERS)]
        ax.errorbar([samples], [steps], xerr=[[samples - fewest_samples], [most_samples - samples]],
                    yerr=[[steps - fewest_steps], [most_steps - steps]], fmt=marker, markersize=11,
                    markeredgecolor="black", color=color(name), capsize=3, zorder=4,
                    label=f"{name} from {entry['start_global_batch_size']}: {verdict}\n(median; bars: its seeds)")
        ax.annotate(name, (samples, steps), fontsize=8, xytext=(7, 4), textcoords="offset points")
        corners += [(samples, steps), (fewest_samples, fewest_steps), (most_samples, most_steps)]
    return corners


def seed_ranges(runs: list[dict], rule: str) -> tuple[tuple[float, float], tuple[float, float]]:
    """(fewest, most) steps and (fewest, most) samples to the target over a rule's runs that reached it ((nan, nan)
    each when none did).

    >>> runs = [{"rule": "ramp", "steps_to_target": 100, "samples_to_target": 9000},
    ...         {"rule": "ramp", "steps_to_target": 120, "samples_to_target": 8800},
    ...         {"rule": "ramp", "steps_to_target": None, "samples_to_target": None},
    ...         {"rule": "tuned", "steps_to_target": 10, "samples_to_target": 320}]
    >>> seed_ranges(runs, "ramp")
    ((100, 120), (8800, 9000))
    """
    reached = [(r["steps_to_target"], r["samples_to_target"]) for r in runs
               if r["rule"] == rule and r["steps_to_target"] is not None and r.get("samples_to_target") is not None]
    if not reached:
        return (math.nan, math.nan), (math.nan, math.nan)
    steps, samples = zip(*reached)
    return (min(steps), max(steps)), (min(samples), max(samples))


def _regimes(ax, fit: dict, batches: list[int]) -> None:
    low, high = fit["regimes"]["perfect_scaling_below"], fit["regimes"]["no_further_gain_above"]
    left, right = batches[0] / 1.3, batches[-1] * 1.3
    ax.axvline(fit["b_crit"], color="tab:green", linestyle="-", alpha=0.5)
    spans = ((left, low, "perfect scaling", "#e8f5e9"), (low, high, "diminishing returns", "#fff8e1"),
             (high, right, "no further gain", "#ffebee"))
    for start, end, name, color in spans:
        start, end = max(start, left), min(end, right)
        if end > start:
            ax.axvspan(start, end, color=color, zorder=0)
            ax.text(math.sqrt(start * end), 0.98, name, transform=ax.get_xaxis_transform(), ha="center", va="top",
                    fontsize=8)
    ax.set_xlim(left, right)


def _median_points(report: dict, rule: str) -> list[tuple[int, float]]:
    fit = report["fit"].get(rule)
    if not fit:
        return []
    return sorted((int(b), s) for b, s in fit["median_steps"].items() if s is not None)


def scale_lr(reference: dict) -> float:
    """The lr a study's rules scaled from (its JSON's ``reference``; a study.json from before says only its lr)."""
    return (reference.get("rules_lr") or {}).get("lr") or reference["lr"]


def _lr_plot(report: dict, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    tuned = report["tuned_lr"]
    if tuned:
        for point in tuned:
            ax.scatter([point["global_batch_size"]] * len(point["sweep"]), point["sweep"], color="lightgray", s=12)
        ax.plot([p["global_batch_size"] for p in tuned], [p["lr"] for p in tuned], "o-", color=_truth_colour(),
                label="best tuned lr")
    ref = report["reference"]
    batches = report["global_batch_sizes"]
    for rule in (rule for rule in registry.known().values() if rule.predicts):
        ax.plot(batches, [scale_lr(ref) * rule.factor(b / ref["global_batch_size"]) for b in batches], "--",
                color=color(rule.name), label=f"{rule.name} rule")
    ax.scatter([ref["global_batch_size"]], [scale_lr(ref)], marker="*", s=120, color="black", label="reference",
               zorder=3)
    batch_axes(ax, "learning rate", "best lr per batch (gray: the sweep)")
    save_figure(plt, fig, path, [ax])


def _curves_plot(report: dict, results: dict, path: str) -> None:
    """The loss and the target's metric along a few best tuned runs; one panel where the target is the loss itself
    (a command study without --metric), else two."""
    plt = pyplot()
    read = report.get("target_read")
    one = read == TRAINING_LOSS
    fig, axes = plt.subplots(1, 1 if one else 2, figsize=(6.5 if one else 12, 4.5), squeeze=False)
    ax_loss, ax_metric = axes[0][0], axes[0][-1]
    tuned = report["tuned_lr"]
    # A few batch sizes spread over the range, each at its best tuned lr, seed 0.
    picks = tuned[::max(1, len(tuned) // 4)] if tuned else []
    cmap = plt.get_cmap("viridis")
    for i, point in enumerate(picks):
        b, lr = point["global_batch_size"], point["lr"]
        key = (lr, 0, point.get("variant", ""))
        run = next((r for r in results.get(b, []) if r.key == key and r.fixed), None)
        if run is None or not run.history:
            continue
        steps, losses, metrics = zip(*run.history)
        color = cmap(i / max(1, len(picks) - 1))
        ax_loss.plot(steps, losses, color=color, label=f"B={b}, lr {lr:.3g}")
        if not one:
            ax_metric.plot(steps, metrics, color=color, label=f"B={b}")
    ax_metric.axhline(report["target"]["value"], color="black", linestyle=":", label="target")
    ax_loss.set_yscale("log")
    labels = ([(ax_loss, "training loss (the ranks' mean between evaluations)")] if one else
              [(ax_loss, "training loss (the step's batch)"),
               (ax_metric, f"{read}, as the command printed it" if read else
                f"validation {report['target']['kind']}")])
    for axis, label in labels:
        axis.set_xscale("log")
        axis.set_xlabel("optimizer step")
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
        legend(axis, fontsize=8)
    write_figure(plt, fig, path)
