"""The study's B_simple against ddplab noise: the same estimator at the same parameters and batches."""

from __future__ import annotations

import os

import pytest

from ddplab.noise import estimators
from ddplab.noise.config import NoiseConfig
from ddplab.noise.measure import measure_spec
from ddplab.study import workloads
from ddplab.study.config import OptimizerConfig, StudyConfig, Target
from ddplab.study.engines import vmap as engine
from ddplab.study.runs import grid_group

SPECS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "specs")
CNN_SPEC = os.path.join(SPECS, "study_cnn.py")


def _frozen_spec(tmp_path, *, dropout: bool) -> str:
    """The CNN spec at lr 0 (its weights never move, so every step measures one model state), with or without
    its dropout."""
    with open(CNN_SPEC, encoding="utf-8") as fh:
        source = fh.read()
    source += "\n\ndef optimizer(params):\n    return torch.optim.AdamW(params, lr=0.0, weight_decay=0.01)\n"
    if not dropout:
        source += "\n\ndef model():\n    cnn = SmallCNN()\n    cnn.head[1].p = 0.0\n    return cnn\n"
    path = tmp_path / ("cnn_frozen.py" if dropout else "cnn_frozen_no_dropout.py")
    path.write_text(source, encoding="utf-8")
    return str(path)


def _engine_measurements(workload, global_batch: int, steps: int, *, seed: int = 0,
                         optimizer: OptimizerConfig | None = None) -> tuple[list[float], list[float]]:
    """The vectorized engine's (|G|², tr Σ) at every step of one lr-0 run: one model state, the run's batches."""
    config = StudyConfig(target=Target(kind="accuracy", value=1.0), global_batch_sizes=(global_batch, 2 * global_batch),
                         optimizer=optimizer or workload.optimizer)
    group = engine.Group(workload, config, grid_group(config, global_batch, [(0.0, seed)]))
    for step in range(steps):
        group.step(step, measure=True)
    return group.results[0].noise_g2, group.results[0].noise_trace


@pytest.mark.timeout(120)
def test_study_and_noise_measure_the_same_per_step_on_the_same_state(tmp_path):
    """At the same parameters (lr 0) and the same batches, the engine's estimate of each step is the one
    ``ddplab noise --world-size 2 --batch-size B/2`` makes on real DDP ranks, BatchNorm included: the engine's
    two halves are the two ranks' shares, each normalized over its own B/2."""
    spec = _frozen_spec(tmp_path, dropout=False)
    global_batch, steps = 64, 12
    report = measure_spec(NoiseConfig(spec_path=spec, world_size=2, per_device_batch_size=global_batch // 2,
                                      steps=steps))
    assert not report.weights_moved and report.b_big == global_batch
    g2s, traces = _engine_measurements(workloads.from_spec(spec), global_batch, steps)
    assert g2s == pytest.approx([r["g2"] for r in report.history], rel=1e-3)
    assert traces == pytest.approx([r["trace_sigma"] for r in report.history], rel=1e-3)


@pytest.mark.timeout(180)
def test_study_and_noise_agree_within_their_intervals_with_dropout(tmp_path):
    """With dropout each forward draws its own masks, so the two measure the same state with different noise:
    each estimate lies within the other's 95% interval."""
    spec = _frozen_spec(tmp_path, dropout=True)
    global_batch, steps = 128, 60
    report = measure_spec(NoiseConfig(spec_path=spec, world_size=2, per_device_batch_size=global_batch // 2,
                                      steps=steps))
    study = estimators.summarize(*_engine_measurements(workloads.from_spec(spec), global_batch, steps))
    noise = report.summary
    assert noise.b_simple_ci95[0] <= study.b_simple <= noise.b_simple_ci95[1]
    assert study.b_simple_ci95[0] <= noise.b_simple <= study.b_simple_ci95[1]


def test_the_estimate_needs_gradients_only_not_the_optimizer():
    """AdamW or plain SGD, the estimates at one state are the same numbers: only the trajectory depends on it."""
    workload = workloads.regression(dim=7, n_train=512, n_val=64)
    adamw = _engine_measurements(workload, 32, 5, optimizer=OptimizerConfig(family="adamw", weight_decay=0.1))
    sgd = _engine_measurements(workload, 32, 5, optimizer=OptimizerConfig(momentum=0.0))
    assert adamw == sgd


@pytest.mark.parametrize("global_batch", [16, 256])
def test_regression_b_simple_is_dim_plus_one_and_tr_sigma_never_negative(global_batch):
    """The noiseless regression has B_simple = dim + 1 at every step: the engine's interval covers it, at a small
    and a large batch, and no step's tr Σ is negative (both halves: tr Σ ∝ |g₀ − g₁|²). One half against the whole
    batch, the estimator before, gave a negative tr Σ on 24 and 39 of these 80 steps, and at 256 the interval
    [0, 12.3], which misses 16."""
    dim = 15
    workload = workloads.regression(dim=dim, n_train=8192, n_val=64)
    g2s, traces = _engine_measurements(workload, global_batch, 80, optimizer=OptimizerConfig(momentum=0.0))
    summary = estimators.summarize(g2s, traces)
    low, high = summary.b_simple_ci95
    assert low <= dim + 1 <= high and high < 2 * (dim + 1)
    assert min(traces) >= 0


def test_finite_data_correction_when_the_batch_is_the_whole_dataset():
    """B = N: every step's batch is the whole training set, so |G_B|² = |G|² exactly, and the halves are random
    halves of it; with the finite-data correction the estimate is the dataset's own tr Σ / |G|² (the 1/N convention),
    computed here from the per-example gradients 2x(x·e) of the linear model at init (e = −w*)."""
    dim, size = 6, 64
    workload = workloads.regression(dim=dim, n_train=size, n_val=16)
    g2s, traces = _engine_measurements(workload, size, 200, optimizer=OptimizerConfig(momentum=0.0))
    inputs, targets = workload.train[0].double(), workload.train[1].double()
    per_example = -2 * inputs * targets  # the model's weight is 0, so x·e = −y
    mean = per_example.mean(0)
    exact_g2 = float(mean.square().sum())
    exact_trace = float(per_example.square().sum(1).mean()) - exact_g2
    assert g2s == pytest.approx([exact_g2] * len(g2s), rel=1e-4)
    summary = estimators.summarize(g2s, traces)
    low, high = summary.b_simple_ci95
    assert low <= exact_trace / exact_g2 <= high


def test_the_study_resolves_b_simple_at_a_large_batch_and_says_where_it_measured():
    """End to end on the regression (B_simple = dim + 1 at every step): the pooled value and each batch's, the
    largest included (where one half against the whole batch read 0), cover dim + 1; the report names the training
    steps measured and gives B_crit / B_simple only from a value its interval tells from zero."""
    from ddplab.study.grid import analysis
    from ddplab.study.grid import training as grid_training

    dim = 15
    workload = workloads.regression(dim=dim, n_train=8192, n_val=1024)
    start = float(workload.val[1].pow(2).mean())
    config = StudyConfig(target=Target(kind="loss", value=start * 1e-3), optimizer=OptimizerConfig(momentum=0.0),
                         rules=("tuned",), global_batch_sizes=(16, 256), reference_global_batch_size=16,
                         reference_lr=0.1, sweep_margin=2, seeds=8, max_steps=400, eval_every=1, dtype="float64")
    results = grid_training.run_grid(workload, config, None, engine.VmapEngine())
    found = analysis.analyze(config, results)
    b_simple = found.b_simple
    for row in [b_simple, *b_simple["by_batch"]]:
        low, high = row["ci95"]
        assert low <= dim + 1 <= high and high < 3 * (dim + 1), row
    best = [r for p in found.tuned_lr for r in results[p["global_batch_size"]] if r.lr == p["lr"] and not r.rule]
    assert b_simple["steps"] == [config.eval_every, max(r.steps_to_target for r in best)]
    assert f"training steps 1 to {b_simple['steps'][1]}" in b_simple["measured"]
    assert b_simple["b_crit_over_b_simple"] is not None
