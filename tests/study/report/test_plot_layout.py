"""The study's figures as a reader sees them: no legend over the points, no batch label over another."""

from __future__ import annotations

import pytest

from ddplab.study.report import figures as plots

pytest.importorskip("matplotlib")

BATCHES = [8, 16, 32, 64, 128, 256, 512, 1024]
# Median steps per rule, shaped like the digits study on docs/commands/study.md.
MEDIANS = {"constant": [880, 230, 135, 140, 115, 135, 125, 135], "linear": [495, 260, 135, 95, 85, 50, None, None],
           "sqrt": [510, 320, 135, 125, 85, 70, 50, 45], "tuned": [490, 225, 135, 95, 85, 45, 50, 40]}


def _fit(medians: list, b_crit: float, s_min: float) -> dict:
    steps = {str(b): s for b, s in zip(BATCHES, medians)}
    return {"median_steps": steps, "b_crit": b_crit, "s_min": s_min, "e_min": s_min * b_crit,
            "seed_range": {b: [s * 0.8, s * 1.3] for b, s in steps.items() if s is not None},
            "band": {}, "regimes": {"perfect_scaling_below": 20.0, "no_further_gain_above": 350.0}}


REPORT = {"workload": "digits-mlp", "target": {"kind": "accuracy", "value": 0.95}, "max_steps": 3000,
          "global_batch_sizes": BATCHES, "rules": list(MEDIANS), "b_simple": {"value": 37.7},
          "fit": {rule: _fit(medians, 85.0, 40.0) for rule, medians in MEDIANS.items()}}


def _drawn(monkeypatch, draw, report: dict, tmp_path):
    """The figure ``draw`` makes of ``report``, laid out as the PNG it wrote."""
    figures = []
    real = plots.write_figure
    monkeypatch.setattr(plots, "write_figure", lambda plt, fig, path: figures.append(fig) or real(plt, fig, path))
    draw(report, str(tmp_path / "plot.png"))
    (figure,) = figures
    figure.canvas.draw()
    return figure


def _points(ax):
    """Every drawn data point of ``ax`` in display pixels (markers, not the fitted curves)."""
    return [tuple(xy) for line in ax.get_lines() if line.get_marker() not in ("None", "", None)
            for xy in ax.transData.transform(line.get_xydata())]


@pytest.mark.timeout(60)
def test_the_steps_plots_legend_covers_none_of_its_points(monkeypatch, tmp_path):
    figure = _drawn(monkeypatch, plots._steps_plot, REPORT, tmp_path)
    ax = figure.axes[0]
    legend = ax.get_legend().get_window_extent()
    points = _points(ax)
    assert len(points) >= 30
    covered = [point for point in points if legend.contains(*point)]
    assert covered == [], covered
    # Every rule and fit is still named.
    names = [text.get_text() for text in ax.get_legend().get_texts()]
    assert any(name.startswith("tuned fit: B_crit") for name in names) and len(names) >= 9


@pytest.mark.timeout(60)
def test_the_steps_plots_axes_are_labelled_in_plain_numbers(monkeypatch, tmp_path):
    figure = _drawn(monkeypatch, plots._steps_plot, REPORT, tmp_path)
    for ax in figure.axes:
        shown = [label.get_text() for minor in (False, True) for axis, coordinate in ((ax.xaxis, 0), (ax.yaxis, 1))
                 for label in axis.get_ticklabels(minor=minor) if label.get_text()
                 and min(axis.get_view_interval()) <= label.get_position()[coordinate] <= max(axis.get_view_interval())]
        # Before: 2³ across and 4×10² up, in matplotlib's mathtext.
        assert shown and all(text.isdigit() for text in shown), shown
    assert {"8", "16", "1024"} <= {label.get_text() for label in figure.axes[0].get_xticklabels()}


@pytest.mark.timeout(60)
def test_the_pareto_plots_batch_labels_overlap_neither_each_other_nor_a_point(monkeypatch, tmp_path):
    figure = _drawn(monkeypatch, plots._pareto_plot, REPORT, tmp_path)
    ax = figure.axes[0]
    labels = [text for text in ax.texts if text.get_text().isdigit()]
    boxes = [text.get_window_extent() for text in labels]
    for i, box in enumerate(boxes):
        for j, other in enumerate(boxes[:i]):
            assert not box.overlaps(other), (labels[i].get_text(), labels[j].get_text())
    # Each batch keeps a label.
    assert {int(text.get_text()) for text in labels} == set(BATCHES)
    for box, text in zip(boxes, labels):
        assert not any(box.contains(*point) for point in _points(ax)), text.get_text()
