"""The study's figures drawn from their JSON: branched.png from a branched.json, its data checked on the figure."""

from __future__ import annotations

import copy
import doctest
import os

import pytest

from ddplab.study.report import branched_figure as report_branched_figure
from ddplab.study.report import figures as report_figures

PNG = b"\x89PNG\r\n\x1a\n"


def _checkpoint(samples_seen: int, critical: int | None, interval: list, b_simple: float | None,
                at_edge: bool = False) -> dict:
    return {"samples_seen": samples_seen, "source": f"step {samples_seen // 32} of the reference run",
            "critical_batch_size": critical, "interval": interval, "at_edge": at_edge, "b_simple": b_simple,
            "reference_loss": 0.25, "tolerance": 0.07, "batches": []}


# The digits measurement on docs/study/branched.md (its per-batch rows left out: the figure does not draw them).
BRANCHED = {
    "workload": "digits-mlp", "global_batch_sizes": [32, 64, 128, 256, 512],
    "reference_run": {"steps": 130, "reached": True, "samples": 4160, "global_batch_size": 32, "lr": 0.1},
    "branches": [_checkpoint(416, 64, [32, 64], 55.59171312994102), _checkpoint(1248, 128, [128, 128], 39.7294),
                 _checkpoint(2496, 128, [32, 128], 44.27232173856254)],
    "schedule": [{"samples_seen": 0, "global_batch_size": 32, "lr": 0.1},
                 {"samples_seen": 416, "global_batch_size": 64, "lr": 0.2},
                 {"samples_seen": 1248, "global_batch_size": 128, "lr": 0.4}],
    "cost": {"branch_samples": 276480, "reference_samples": 4160, "relative": 276480 / 4160},
}


def _drawn(monkeypatch, values: dict, directory: str):
    """branched_plot's figure, kept open, and the path it wrote."""
    figures = []
    real = report_figures.write_figure
    monkeypatch.setattr(report_branched_figure, "write_figure",
                        lambda plt, fig, path: figures.append(fig) or real(plt, fig, path))
    path = report_branched_figure.branched_plot(values, directory)
    return figures[0].axes[0], path


def test_the_modules_doctests_hold():
    assert [doctest.testmod(module).failed for module in (report_figures, report_branched_figure)] == [0, 0]


@pytest.mark.timeout(60)
def test_branched_png_draws_the_critical_batch_b_simple_the_schedule_and_the_cost(tmp_path, monkeypatch):
    ax, path = _drawn(monkeypatch, BRANCHED, str(tmp_path))
    assert path == os.path.join(tmp_path, "branched.png")
    with open(path, "rb") as fh:
        assert fh.read(8) == PNG
    lines = {line.get_label(): line for line in ax.get_lines()}
    # The schedule: 32 from 0, 64 from 416, 128 from 1248 on, drawn to the end of the reference run (4160 samples).
    schedule = lines["batch schedule"]
    assert list(schedule.get_xdata()) == [0, 416, 416, 1248, 1248, 4160]
    assert list(schedule.get_ydata()) == [32, 32, 64, 64, 128, 128]
    b_simple = lines["B_simple at the checkpoint"]
    assert list(b_simple.get_xdata()) == [416, 1248, 2496]
    assert list(b_simple.get_ydata()) == [55.59171312994102, 39.7294, 44.27232173856254]
    # The critical batches with their seeds' intervals as bars: [32, 64], [128, 128], [32, 128].
    critical = next(c for c in ax.containers if c.get_label().startswith("critical batch (bars"))
    marker, _, (bars,) = critical.lines
    assert list(marker.get_xdata()) == [416, 1248, 2496] and list(marker.get_ydata()) == [64, 128, 128]
    assert [tuple(segment[:, 1]) for segment in bars.get_segments()] == [(32, 64), (128, 128), (32, 128)]
    assert ax.get_yscale() == "log" and [t for t in ax.get_yticks() if 32 <= t <= 512] == [32, 64, 128, 256, 512]
    assert "276480 branch samples = 66.5× one reference run (4160 samples)" in ax.get_title()
    assert f"{276480 / 4160:.3g}" == "66.5"


@pytest.mark.timeout(60)
def test_a_critical_batch_at_the_grids_top_is_an_open_marker_with_an_arrow_and_gaps_are_left_out(tmp_path,
                                                                                                 monkeypatch):
    values = copy.deepcopy(BRANCHED)
    # From your own checkpoints: no reference run, the last checkpoint the reference; one checkpoint whose reference
    # batch diverged (no critical batch), one where |G|² was not resolved (no B_simple), one at the grid's top.
    values["reference_run"] = None
    values["cost"] = {"branch_samples": 276480, "reference_samples": 5000, "relative": 276480 / 5000}
    values["branches"] = [_checkpoint(416, None, [None, None], 55.6), _checkpoint(1248, 128, [64, 256], None),
                          _checkpoint(5000, 512, [256, 512], 300.0, at_edge=True)]
    values["schedule"] = [{"samples_seen": 0, "global_batch_size": 32, "lr": 0.1},
                          {"samples_seen": 1248, "global_batch_size": 64, "lr": None},
                          {"samples_seen": 5000, "global_batch_size": 256, "lr": 0.8}]
    ax, path = _drawn(monkeypatch, values, str(tmp_path))
    with open(path, "rb") as fh:
        assert fh.read(8) == PNG
    edge = next(c for c in ax.containers if c.get_label().startswith("critical batch at the grid's top"))
    marker = edge.lines[0]
    assert list(marker.get_xdata()) == [5000] and list(marker.get_ydata()) == [512]
    assert marker.get_markerfacecolor() in ("white", (1.0, 1.0, 1.0, 1.0)) and marker.get_marker() == "^"
    arrows = [a for a in ax.texts if getattr(a, "arrow_patch", None) is not None]
    assert [(a.xy, a.xyann) for a in arrows] == [((5000, 512 * 1.7), (5000, 512))]
    inner = next(c for c in ax.containers if c.get_label().startswith("critical batch (bars"))
    assert list(inner.lines[0].get_xdata()) == [1248]  # the diverged checkpoint has no point
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["B_simple at the checkpoint"].get_xdata()) == [416, 5000]
    # The last step reaches the last checkpoint; the y axis holds B_simple and the arrow above the grid.
    assert list(lines["batch schedule"].get_xdata()) == [0, 1248, 1248, 5000, 5000, 5000]
    assert ax.get_ylim()[1] >= 512 * 1.7
    assert "end of the reference run" not in " ".join(lines)
    assert [t.get_text() for t in ax.texts if t.get_text()] == ["32 (lr 0.1)", "64", "256 (lr 0.8)"]


def _run(rule: str, seed: int, steps: int | None, samples: int | None) -> dict:
    return {"rule": rule, "global_batch_size": 32, "seed": seed, "steps_to_target": steps, "samples_to_target": samples}


@pytest.mark.timeout(60)
def test_the_pareto_plot_marks_each_rule_whose_batch_changes_at_its_medians_with_its_seeds_range(tmp_path,
                                                                                                monkeypatch):
    fixed = {"32": 135.0, "64": 95.0, "128": 85.0}
    report = {"rules": ["tuned", "ramp", "schedule"],
              "fit": {"tuned": {"s_min": 66.467, "e_min": 2109.357, "b_crit": 31.735, "median_steps": fixed}},
              "runs": [_run("ramp", 0, 120, 9600), _run("ramp", 1, 105, 9200), _run("ramp", 2, 100, 8800),
                       _run("schedule", 0, 80, 8160), _run("schedule", 1, 55, 4800), _run("schedule", 2, None, None)],
              "adaptive": {"ramp": {"median_steps": 105.0, "median_samples": 9200.0, "start_global_batch_size": 32,
                                    "dominated_by": [64]},
                           "schedule": {"median_steps": 80.0, "median_samples": 8160.0, "start_global_batch_size": 32,
                                        "dominated_by": []}}}
    figures = []
    real = report_figures.write_figure
    monkeypatch.setattr(report_figures, "write_figure",
                        lambda plt, fig, path: figures.append(fig) or real(plt, fig, path))
    report_figures._pareto_plot(report, str(tmp_path / "pareto.png"))
    ax = figures[0].axes[0]
    marked = {c.get_label().split(" ")[0]: c for c in ax.containers}
    assert set(marked) == {"ramp", "schedule"}
    assert "dominated by batch 64" in marked["ramp"].get_label()
    assert "no fixed batch has fewer of both" in marked["schedule"].get_label()
    for name, (samples, steps), (x_range, y_range) in (("ramp", (9200, 105), ((8800, 9600), (100, 120))),
                                                       ("schedule", (8160, 80), ((4800, 8160), (55, 80)))):
        point, _, (x_bars, y_bars) = marked[name].lines
        assert (list(point.get_xdata()), list(point.get_ydata())) == ([samples], [steps])
        assert tuple(x_bars.get_segments()[0][:, 0]) == x_range and tuple(y_bars.get_segments()[0][:, 1]) == y_range
    assert marked["ramp"].lines[0].get_marker() != marked["schedule"].lines[0].get_marker()
    # The axes hold every point and bar, the fixed batches' (steps × batch, steps) among them.
    low, high = ax.get_xlim()
    assert low < min(4800, 2109.357, 32 * 135) and high > max(9600, 128 * 85)
    with open(tmp_path / "pareto.png", "rb") as fh:
        assert fh.read(8) == PNG


@pytest.mark.timeout(60)
def test_plots_are_written_where_they_have_content_their_bands_named_their_ticks_plain_and_nothing_warned(
        tmp_path, monkeypatch, recwarn):
    # A study of fixed rules only: no tuned sweep, so no best lrs to draw; the constant rule never reached at two
    # batches, so the compute side has nothing either.
    fit = {"s_min": 100.0, "b_crit": 64.0, "b_crit_ci95": [40.0, 90.0], "e_min": 6400.0,
           "median_steps": {"16": 500.0, "32": 300.0, "64": 200.0},
           "seed_range": {"16": [480, 520], "32": [290, 310], "64": [190, 210]},
           "band": {"16": [450.0, 550.0], "32": [280.0, 320.0], "64": [185.0, 215.0]}}
    report = {"rules": ["linear"], "global_batch_sizes": [16, 32, 64], "fit": {"linear": fit}, "tuned_lr": [],
              "reference": {"global_batch_size": 16, "lr": 0.1}, "target": {"kind": "loss", "value": 1.0},
              "workload": "w", "max_steps": 1000, "runs": [], "b_simple": None}
    figures = []
    real = report_figures.write_figure
    monkeypatch.setattr(report_figures, "write_figure",
                        lambda plt, fig, path: figures.append(fig) or real(plt, fig, path))
    paths = report_figures.plots(report, {}, str(tmp_path))
    assert [p.rsplit("/", 1)[1] for p in paths] == ["steps_vs_batch.png", "loss_curves.png", "pareto.png"]
    steps = figures[0].axes[0]
    assert "linear fit's 95% band (seeds resampled)" in steps.get_legend_handles_labels()[1]
    # Plain numbers on the log axes, not 2×10^1.
    figures[0].canvas.draw()
    labels = [t.get_text() for t in steps.get_xticklabels() + steps.get_yticklabels() if t.get_text()]
    assert labels and not [t for t in labels if "times" in t or "^" in t], labels
    assert not [w for w in recwarn if "legend" in str(w.message).lower()], [str(w.message) for w in recwarn]
    # The loss curves: a spec's study draws the training loss beside its validation metric, two panels.
    curves = figures[1]
    assert [axis.get_ylabel() for axis in curves.axes] == ["training loss (the step's batch)", "validation loss"]


@pytest.mark.timeout(60)
def test_a_command_studys_loss_curves_label_what_the_target_is_read_from(tmp_path, monkeypatch):
    """Without --metric the target is the training loss: one panel, not the same curve twice under two labels; with
    --metric the second panel names the metric the command printed."""
    from ddplab.study.report.records import TRAINING_LOSS
    from ddplab.study.runs import RunResult

    run = RunResult(global_batch_size=16, lr=0.01, seed=0)
    run.history = [[5, 2.0, 2.0], [10, 1.6, 1.6]]
    report = {"tuned_lr": [{"global_batch_size": 16, "lr": 0.01, "variant": ""}],
              "target": {"kind": "loss", "value": 1.7}, "target_read": TRAINING_LOSS}
    figures = []
    real = report_figures.write_figure
    monkeypatch.setattr(report_figures, "write_figure",
                        lambda plt, fig, path: figures.append(fig) or real(plt, fig, path))
    report_figures._curves_plot(report, {16: [run]}, str(tmp_path / "one.png"))
    (axis,) = figures[0].axes
    assert axis.get_ylabel() == "training loss (the ranks' mean between evaluations)"
    assert [line.get_label() for line in axis.get_lines()] == ["B=16, lr 0.01", "target"]
    report_figures._curves_plot(report | {"target_read": "val_loss"}, {16: [run]}, str(tmp_path / "two.png"))
    assert [axis.get_ylabel() for axis in figures[1].axes] == ["training loss (the step's batch)",
                                                              "val_loss, as the command printed it"]
    # report.html says the same of its steps to the target.
    from ddplab.study.report import html

    assert html._read_from(report) == "the training loss (the ranks' mean between evaluations)"
    assert html._read_from(report | {"target_read": "val_loss"}) == "val_loss, as the command printed it,"
    assert html._read_from(report | {"target_read": None}) == "validation loss"
