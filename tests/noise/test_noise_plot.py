"""The --plot of ddplab noise as a reader sees it: a title that says what was measured, plain numbers on its axis."""

import math

import numpy
import pytest

pytest.importorskip("matplotlib")


def _figure(monkeypatch, tmp_path, ema: list[float]):
    """The figure _plot draws for a run whose running B_simple went through ``ema``."""
    from matplotlib.figure import Figure

    from ddplab.cli import noise as command
    from ddplab.noise import estimators as est
    from ddplab.noise.config import NoiseConfig
    from ddplab.noise.report import NoiseReport

    rng = numpy.random.default_rng(0)
    summary = est.summarize(list(1.0 + 0.01 * rng.standard_normal(40)), list(40 + rng.standard_normal(40)))
    config = NoiseConfig(spec_path="x.py", world_size=2, per_device_batch_size=8, steps=40)
    history = [{"step": step, "b_simple_ema": value} for step, value in enumerate(ema)]
    report = NoiseReport(config=config, summary=summary, b_small=8, b_big=16, dataset_size=500,
                         weights_moved=True, lr=[0.1], history=history, completed_steps=len(ema))
    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *args, **kwargs: drawn.append(fig))
    command._plot(report, str(tmp_path / "gns.png"))
    (figure,) = drawn
    figure.canvas.draw()
    return figure.axes[0]


def test_the_noise_plot_has_a_title_and_plain_tick_labels(monkeypatch, tmp_path):
    ax = _figure(monkeypatch, tmp_path, [20 + 60 * step / 39 for step in range(40)])
    assert ax.get_title() == "gradient noise scale: 2 ranks × 8 per device (global batch 16)"
    labels = [label.get_text() for minor in (False, True) for label in ax.get_yticklabels(minor=minor)]
    shown = [text for text in labels if text]
    # Before: "$\mathdefault{4\times10^{1}}$", drawn as 4×10¹.
    assert shown and all(text.replace(".", "").isdigit() for text in shown), shown
    assert {"20", "40"} <= set(shown)


def test_a_plot_without_any_positive_estimate_keeps_a_linear_axis(monkeypatch, tmp_path):
    ax = _figure(monkeypatch, tmp_path, [math.nan] * 5)
    assert ax.get_yscale() == "linear" and ax.get_title().startswith("gradient noise scale: 2 ranks")
