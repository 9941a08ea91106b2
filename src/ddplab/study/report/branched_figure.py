"""The critical batch as training goes, drawn: each checkpoint's critical batch with its seeds' interval and
B_simple, and the batch schedule they imply.
"""

from __future__ import annotations

import os

from ddplab.study.report.figures import pyplot, write_figure

SCHEDULE_COLOUR = "crimson"
"""The batch schedule's line: the colour the grid's figures give the rule that follows such a schedule."""


def branched_plot(values: dict, directory: str) -> str:
    """``branched.png`` under ``directory`` from a ``branched.json``'s values: the critical batch at each checkpoint
    against the samples seen (bars: its interval from the seeds; an open triangle with an arrow where it is the
    largest branched batch, the true one perhaps above the grid), B_simple at the same checkpoints, the batch
    schedule they imply as a step line, and the measurement's cost relative to one reference run. Returns its path."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    _critical_points(ax, values["branches"])
    noise = [(b["samples_seen"], b["b_simple"]) for b in values["branches"] if b["b_simple"] and b["b_simple"] > 0]
    if noise:
        ax.plot(*zip(*noise), "s", color="tab:purple", label="B_simple at the checkpoint")
    end = schedule_end(values)
    xs, ys = schedule_line(values["schedule"], end)
    ax.plot(xs, ys, "-", color=SCHEDULE_COLOUR, linewidth=2, alpha=0.8, label="batch schedule")
    for step in values["schedule"]:
        lr = f" (lr {step['lr']:.3g})" if step["lr"] is not None else ""
        ax.annotate(f"{step['global_batch_size']}{lr}", (step["samples_seen"], step["global_batch_size"]), fontsize=7,
                    xytext=(3, 3), textcoords="offset points", color=SCHEDULE_COLOUR)
    if values["reference_run"] is not None:
        ax.axvline(values["reference_run"]["samples"], color="gray", linestyle=":",
                   label="end of the reference run" + (" (target reached)" if values["reference_run"]["reached"]
                                                        else " (target not reached)"))
    grid = values["global_batch_sizes"]
    ax.set_yscale("log", base=2)
    ax.set_yticks(grid, [str(b) for b in grid])
    # The grid, B_simple beyond it and the arrows of a critical batch at its top, with room for the bars' caps.
    shown = [*grid, *(value for _, value in noise)]
    ax.set_ylim(min(shown) / 1.25, max(shown) * 1.8)
    ax.set_xlim(0, end * 1.04)
    ax.set_xlabel("samples seen (the run's checkpoints)")
    ax.set_ylabel("global batch")
    ax.set_title(f"{values['workload']}: the critical batch as training goes (branches at {grid[0]}…{grid[-1]})\n"
                 f"{cost_text(values['cost'])}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    path = os.path.join(directory, "branched.png")
    write_figure(plt, fig, path)
    return path


def _critical_points(ax, branches: list[dict]) -> None:
    """The critical batch per checkpoint with its seeds' interval; one at the grid's top marked as a lower bound."""
    found = [b for b in branches if b["critical_batch_size"] is not None]
    for at_edge in (False, True):
        points = [b for b in found if b["at_edge"] == at_edge]
        if not points:
            continue
        xs, ys = [b["samples_seen"] for b in points], [b["critical_batch_size"] for b in points]
        lows = [y - (b["interval"][0] or y) for b, y in zip(points, ys)]
        highs = [(b["interval"][1] or y) - y for b, y in zip(points, ys)]
        label = ("critical batch at the grid's top: it may lie above" if at_edge else
                 "critical batch (bars: worst and best seed)")
        ax.errorbar(xs, ys, yerr=(lows, highs), fmt="^" if at_edge else "o", markersize=8, capsize=4,
                    color="tab:blue", markerfacecolor="white" if at_edge else "tab:blue", label=label, zorder=3)
        for x, y in zip(xs, ys) if at_edge else ():
            ax.annotate("", xy=(x, y * 1.7), xytext=(x, y), arrowprops={"arrowstyle": "->", "color": "tab:blue"})


def schedule_end(values: dict) -> int:
    """Where the schedule's last step is drawn to: one reference run's samples, or the last checkpoint if later."""
    last = max((b["samples_seen"] for b in values["branches"]), default=0)
    return max(last, values["cost"]["reference_samples"] or 0, values["schedule"][-1]["samples_seen"])


def schedule_line(schedule: list[dict], end: int) -> tuple[list[int], list[int]]:
    """The schedule's global batch against samples seen as a step line's vertices, from its first entry to ``end``.

    >>> schedule_line([{"samples_seen": 0, "global_batch_size": 32, "lr": 0.1},
    ...                {"samples_seen": 416, "global_batch_size": 64, "lr": 0.2}], 4160)
    ([0, 416, 416, 4160], [32, 32, 64, 64])
    """
    xs, ys = [], []
    for step, following in zip(schedule, [*schedule[1:], None]):
        until = following["samples_seen"] if following else end
        xs += [step["samples_seen"], until]
        ys += [step["global_batch_size"]] * 2
    return xs, ys


def cost_text(cost: dict) -> str:
    """The measurement's cost in words, relative to one reference run where there is one.

    >>> cost_text({"branch_samples": 276480, "reference_samples": 4160, "relative": 66.46153846153847})
    'measurement: 276480 branch samples = 66.5× one reference run (4160 samples)'
    """
    relative = f" = {cost['relative']:.3g}× one reference run ({cost['reference_samples']} samples)" \
        if cost["relative"] is not None else ""
    return f"measurement: {cost['branch_samples']} branch samples{relative}"
