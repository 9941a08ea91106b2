"""ddplab study: the fit against exact curves, the vectorized engine against exact theory and real DDP, the CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import statistics

import pytest
import torch

from ddplab.cli import render
from ddplab.cli.main import main
from ddplab.errors import UsageError
from ddplab.plan import from_study
from ddplab.study import fit as study_fit
from ddplab.study import workloads
from ddplab.study.config import OptimizerConfig, StudyConfig, Target
from ddplab.study.engines import vmap as engine
from ddplab.study.grid import analysis, verify
from ddplab.study.grid import training as grid_training
from ddplab.study.rules import registry, sweep
from ddplab.study.runs import grid_group

PLAIN_SGD = OptimizerConfig(momentum=0.0)
SPECS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "specs")

# ---------------------------------------------------------------------------------------------
# The pure fit


@pytest.mark.parametrize("b_crit", [3.0, 40.0, 500.0])
def test_fit_recovers_exact_curve(b_crit):
    batches = [2 ** k for k in range(1, 12)]
    fit = study_fit.fit_steps(batches, [120.0 * (1 + b_crit / b) for b in batches])
    assert fit.b_crit == pytest.approx(b_crit, rel=1e-9)
    assert fit.s_min == pytest.approx(120.0, rel=1e-9)
    assert fit.e_min == pytest.approx(120.0 * b_crit, rel=1e-9)


def test_fit_within_ten_percent_of_steps_counted_every_k():
    # Steps are only seen at evaluations every k: S is rounded up to a multiple of k.
    batches, k, b_crit = [2 ** i for i in range(3, 11)], 5, 96.0
    steps = [k * math.ceil(200 * (1 + b_crit / b) / k) for b in batches]
    assert study_fit.fit_steps(batches, steps).b_crit == pytest.approx(b_crit, rel=0.10)


def test_fit_edges_no_bend_and_no_gain():
    batches = [8, 16, 32, 64]
    assert study_fit.fit_steps(batches, [6400 / b for b in batches]).b_crit == math.inf
    # Perfect scaling whose least squares leave an S_min of rounding size (2e-16) is still no bend.
    for steps, sizes in ((640, (8, 32, 128)), (1000, (16, 64, 256, 1024)), (37, (32, 64, 128))):
        assert study_fit.fit_steps(sizes, [steps / b for b in sizes]).b_crit == math.inf
    flat = study_fit.fit_steps(batches, [50.0] * 4)
    assert flat.b_crit == 0 and flat.s_min == pytest.approx(50.0)
    with pytest.raises(ValueError, match="two or more"):
        study_fit.fit_steps([8, 16], [math.inf, 10.0])


def test_bootstrap_over_seeds_covers_the_truth():
    rng = random.Random(7)
    truth, s_min = 64.0, 100.0
    batches = [2 ** i for i in range(2, 11)]
    # Each seed's run lands within ±10% of the curve, independently per batch.
    steps = {b: [s_min * (1 + truth / b) * math.exp(rng.gauss(0, 0.05)) for _ in range(5)] for b in batches}
    fit = study_fit.fit_seeds(steps, n_boot=300)
    assert fit["b_crit"] == pytest.approx(truth, rel=0.10)
    low, high = fit["b_crit_ci95"]
    assert low < truth < high and high / low < 2
    assert fit["regimes"]["perfect_scaling_below"] == pytest.approx(fit["b_crit"] / 4)
    # The fitted curve's 95% band holds the true curve at (nearly) every batch, and is narrow where seeds agree.
    inside = [fit["band"][b][0] <= s_min * (1 + truth / b) <= fit["band"][b][1] for b in batches]
    assert sum(inside) >= len(batches) - 1
    assert all(high / low < 1.3 for low, high in fit["band"].values())


def test_median_counts_unreached_runs_as_infinite():
    assert study_fit.median([3.0, math.inf, 5.0]) == 5.0
    assert study_fit.median([math.inf, math.inf, 5.0]) == math.inf
    assert study_fit.best_lr({0.1: [math.inf] * 3, 0.2: [10.0, 12.0, math.inf]}) == (0.2, 12.0)
    assert study_fit.best_lr({0.1: [math.inf] * 3}) is None


def test_the_measured_lr_is_interpolated_log_log():
    study_json = {"workload": "w", "fit": {"tuned": {"b_crit": 123.0}},
                  "tuned_lr": [{"global_batch_size": b, "lr": 0.01 * math.sqrt(b)} for b in (16, 64, 256)]}
    source = from_study.StudyLr(from_study.load_study(study_json))
    # lr ∝ √B is a straight line in log-log: interpolation is exact.
    measured = source(32)
    assert measured.lr == pytest.approx(0.01 * math.sqrt(32)) and "tuned curve" in measured.reason
    assert measured.warnings == () and "B_crit 123" in measured.reason
    # Up to 2× past the measured batches the end segment goes on; past that, the optimizer's rule (SGD: linear) from
    # the best lr at the largest batch.
    near = source(512)
    assert near.lr == pytest.approx(0.01 * math.sqrt(512)) and "outside" in near.warnings[0]
    far = source(1024)
    assert far.lr == pytest.approx(0.16 * 4) and "the linear rule from the best lr 0.16" in far.reason
    with pytest.raises(UsageError, match="tuned"):
        from_study.load_study({"fit": {}, "tuned_lr": []})


# ---------------------------------------------------------------------------------------------
# Grid and data order


def test_sweep_spans_both_rules_and_rules_share_runs():
    config = StudyConfig(target=Target(kind="accuracy", value=0.9), reference_global_batch_size=32, reference_lr=0.05,
                               sweep_margin=2.0)
    assert registry.get("tuned").grid_lrs(config, 128) == pytest.approx([0.025, 0.05, 0.1, 0.2, 0.4])
    lrs = sweep.lrs(config, 32)
    # At the reference batch constant, linear and sqrt are one run, also a sweep point.
    assert lrs[0.05] == ["constant", "linear", "sqrt", "tuned"]


def test_global_batch_is_the_union_of_ddp_rank_batches():
    from ddplab.runtime.sharding import rank_indices

    size, world, global_batch = 103, 4, 16
    batches = engine.Batches(size, global_batch, [5])
    for step in (0, 3, 6, 9):
        per_epoch = size // global_batch
        epoch, within = divmod(step, per_epoch)
        per_device = global_batch // world
        union = sorted(i for r in range(world) for i in
                       rank_indices(size, world_size=world, rank=r, seed=5, epoch=epoch)[
                           within * per_device:(within + 1) * per_device])
        assert union == sorted(batches.indices(step)[0].tolist())


# ---------------------------------------------------------------------------------------------
# The engine against exact theory


def test_regression_steps_match_exact_recursion():
    dim, target_ratio = 31, 0.05
    workload = workloads.regression(dim=dim, n_train=8192, n_val=8192)
    start = float(workload.val[1].pow(2).mean())
    config = StudyConfig(target=Target(kind="loss", value=start * target_ratio), optimizer=PLAIN_SGD,
                               global_batch_sizes=(8, 64), reference_global_batch_size=8, reference_lr=0.05, seeds=4,
                               max_steps=400, eval_every=1, dtype="float64")
    for b, lr in ((8, 0.05), (64, 0.2)):
        runs = engine.train_group(workload, config, grid_group(config, b, [(lr, s) for s in range(config.seeds)]))
        exact = workloads.regression_expected_steps(dim=dim, global_batch=b, lr=lr, start=start,
                                                target=start * target_ratio)
        measured = study_fit.median([r.steps_to_target for r in runs])
        assert measured == pytest.approx(exact, rel=0.15), (b, measured, exact)


def test_study_fit_matches_fit_of_exact_regression_curve():
    # End to end: tuned sweep, medians over seeds, fit; against the same sweep's exact expected steps.
    dim, ratio = 15, 1e-6
    workload = workloads.regression(dim=dim, n_train=8192, n_val=4096)
    start = float(workload.val[1].pow(2).mean())
    config = StudyConfig(target=Target(kind="loss", value=start * ratio), optimizer=PLAIN_SGD, rules=("tuned",),
                         global_batch_sizes=(2, 4, 8, 16, 32, 64, 128), reference_global_batch_size=16,
                         reference_lr=0.1, sweep_factor=2 ** 0.5, sweep_margin=4, seeds=7, max_steps=600, eval_every=1,
                         dtype="float64")
    # 7 seeds: with 3, the median run is up to 19% ahead of the expected error's steps (Jensen) at some batch.
    found = analysis.analyze(config, grid_training.run_grid(workload, config, None, engine.VmapEngine()))
    exact = {b: min(s for lr in registry.get("tuned").grid_lrs(config, b) if (s := workloads.regression_expected_steps(
        dim=dim, global_batch=b, lr=lr, start=start, target=start * ratio)) is not None)
        for b in config.global_batch_sizes}
    measured = found.fit["tuned"]["median_steps"]
    for b, steps in exact.items():
        assert measured[str(b)] == pytest.approx(steps, rel=0.15, abs=1)
    exact_fit = study_fit.fit_steps(list(exact), list(exact.values()))
    # Medians of random runs run slightly ahead of the expected |e|² (Jensen): 15%, not exact.
    assert found.fit["tuned"]["b_crit"] == pytest.approx(exact_fit.b_crit, rel=0.15)
    low, high = found.fit["tuned"]["b_crit_ci95"]
    assert low <= found.fit["tuned"]["b_crit"] <= high


def test_b_simple_along_runs_matches_gaussian_theory():
    from ddplab.noise import estimators as noise_estimators

    dim = 15
    workload = workloads.regression(dim=dim, n_train=8192, n_val=2048)
    start = float(workload.val[1].pow(2).mean())
    config = StudyConfig(target=Target(kind="loss", value=start * 0.01), optimizer=PLAIN_SGD,
                               global_batch_sizes=(8, 64), seeds=32, max_steps=400, eval_every=1, dtype="float64")
    runs = engine.train_group(workload, config, grid_group(config, 64, [(0.1, s) for s in range(config.seeds)]))
    g2s = [g for r in runs for g in r.noise_g2]
    traces = [t for r in runs for t in r.noise_trace]
    # tr Σ / |G|² = dim + 1 exactly for Gaussian inputs, at every step; |G|² shrinks along the runs, so the
    # ratio of means is noisy: the exact value must lie in its 95% interval, the estimate within 40%.
    summary = noise_estimators.summarize(g2s, traces)
    low, high = summary.b_simple_ci95
    assert low <= dim + 1 <= high and summary.b_simple == pytest.approx(dim + 1, rel=0.4)


def test_vectorized_group_equals_one_run_at_a_time():
    workload = workloads.regression(dim=8, n_train=256, n_val=64)
    config = StudyConfig(target=Target(kind="loss", value=1e-9), global_batch_sizes=(16, 32),
                               dtype="float64")
    points = [(16, 0.01, 0), (16, 0.1, 1), (16, 0.05, 2)]
    together = verify.simulated_params(workload, config, points, 25)
    alone = [verify.simulated_params(workload, config, [p], 25)[0] for p in points]
    for a, b in zip(together, alone):
        assert torch.allclose(a["weight"], b["weight"], rtol=0, atol=1e-12)


def test_adascale_runs_are_the_library_adapter_on_torch_sgd():
    """The engine's vectorized AdaScale runs take, step for step, the updates of torch.optim.SGD driven by
    ddplab.AdaScale from the same |G|² and tr Σ estimates (float64)."""
    from types import SimpleNamespace

    from ddplab.adapt.adascale import AdaScale
    from ddplab.noise import estimators

    workload = workloads.regression(dim=8, n_train=512, n_val=64)
    config = StudyConfig(target=Target(kind="loss", value=1e-12), global_batch_sizes=(16, 64), rules=("adascale",),
                         reference_global_batch_size=16, reference_lr=0.02, dtype="float64")
    batch, half, steps = 64, 32, 40
    group = engine.Group(workload, config, registry.get("adascale").group(config, batch, {}))
    for step in range(steps):
        group.step(step, measure=True)

    model = workload.model().to(torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=config.optimizer.momentum)
    measured = SimpleNamespace(b_big=batch, history=[])
    adascale = AdaScale(optimizer, measured, reference_batch_size=16)
    order = engine.Batches(workload.train_size, batch, [0])
    inputs, targets = workload.train[0].to(torch.float64), workload.train[1].to(torch.float64)

    def grad(x, y):
        return torch.cat([g.flatten() for g in torch.autograd.grad(workload.loss(model(x), y), model.parameters())])

    for step in range(steps):
        index = order.indices(step)[0]
        x, y = inputs[index], targets[index]
        # The two DDP ranks' shares of the batch (even and odd positions), as ddplab noise measures at world size 2.
        shares = [grad(x[rank::2], y[rank::2]) for rank in (0, 1)]
        small_sq = float(sum(g.pow(2).sum() for g in shares)) / 2
        g2, trace = estimators.unbiased_estimates(small_sq, float((sum(shares) / 2).pow(2).sum()), half, batch,
                                                  dataset_size=workload.train_size)
        measured.history.append(SimpleNamespace(g2=g2, trace_sigma=trace))
        optimizer.zero_grad()
        workload.loss(model(x), y).backward()
        optimizer.step()
    gains = [g[1] for g in group.results[0].gains]
    assert gains == pytest.approx([h.gain for h in adascale.history], rel=1e-10)
    # A noisy problem (B_simple = dim + 1 = 9 against the reference batch 16): the gain is well above 1.
    assert 1.2 < gains[-1] < 4 and group.results[0].gains[-1][2] == pytest.approx(sum(gains), rel=1e-12)
    assert torch.allclose(group.params["weight"][0], model.weight.detach(), rtol=1e-10, atol=1e-14)


def test_a_ramp_that_cannot_grow_is_the_fixed_run_at_its_batch():
    """With the grid's largest batch its start, the ramp run (torch SGD, two micro-batches per step, the library's
    BatchRamp) is the vectorized constant-lr run of the same seed, evaluation for evaluation (float64)."""
    workload = workloads.regression(dim=8, n_train=512, n_val=64)
    config = StudyConfig(target=Target(kind="loss", value=1e-12), global_batch_sizes=(16,), rules=("constant", "ramp"),
                         reference_global_batch_size=16, reference_lr=0.05, seeds=2, max_steps=40, dtype="float64")
    runs = grid_training.run_grid(workload, config, None, engine.VmapEngine())[16]
    fixed = {r.seed: r for r in runs if r.rule != "ramp"}
    ramped = {r.seed: r for r in runs if r.rule == "ramp"}
    assert sorted(ramped) == [0, 1] and all(r.lr == 0.05 for r in ramped.values())
    for seed, run in ramped.items():
        assert [h[0] for h in run.history] == [h[0] for h in fixed[seed].history] == list(range(5, 41, 5))
        assert [h[2] for h in run.history] == pytest.approx([h[2] for h in fixed[seed].history], rel=1e-9)
        assert {t[1] for t in run.trajectory} == {16}


@pytest.mark.timeout(90)
def test_verify_ddp_two_ranks_float64():
    workload = workloads.regression(dim=8, n_train=512, n_val=64)
    config = StudyConfig(target=Target(kind="loss", value=1e-3), global_batch_sizes=(16, 64),
                               reference_lr=0.05, seeds=2, dtype="float64")
    verdict = verify.verify_ddp(workload, config, 3, world_size=2, steps=12)
    assert len(verdict.points) == 3
    assert verdict.max_abs_diff < 1e-12
    # And the comparison can fail: a different lr on the DDP side shows up.
    points = verify.verify_points(config, 1, 2)
    moved = verify.simulated_params(workload, config, [(points[0][0], points[0][1] * 1.01, points[0][2])], 12)[0]
    assert float(
        (moved["weight"] - verify.simulated_params(workload, config, points, 12)[0]["weight"]).abs().max()) > 1e-6


# ---------------------------------------------------------------------------------------------
# The command


def _study(tmp_path, *extra):
    return ["study", "--global-batch-sizes", "32,128", "--seeds", "2", "--max-steps", "200", "--target-accuracy", "0.9",
            "--sweep-margin", "2", "--sweep-factor", "4", "--engine", "vmap",
            "--out", str(tmp_path / "out"), *extra]


@pytest.mark.timeout(120)
def test_cli_json_resume_and_fresh(tmp_path, capsys, monkeypatch):
    assert main(_study(tmp_path, "--json", "--rules", "linear,tuned")) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert captured.err == ""  # no matplotlib or torch warning leaks into the command's output
    for key in ("workload", "target", "rules", "global_batch_sizes", "runs", "fit", "b_simple", "plots", "report",
                "seconds"):
        assert key in report
    assert {r["rule"] for r in report["runs"]} == {"linear", "tuned"}
    # 2 seeds: the intervals say they are too narrow to lean on.
    assert report["fit"] and report["warnings"].count(analysis.FEW_SEEDS) == 1
    assert all(set(r) >= {"rule", "global_batch_size", "lr", "seed", "steps_to_target"} for r in report["runs"])
    assert all(os.path.exists(p) for p in report["plots"]) and os.path.exists(report["report"])
    with open(report["report"]) as fh:
        assert "data:image/png;base64," in fh.read()
    # Run again: nothing retrains, the same answer comes back from the cache.
    calls = []

    real = engine.VmapEngine.train
    monkeypatch.setattr(engine.VmapEngine, "train",
                        lambda self, w, c, g, *a: calls.append(g.global_batch_size) or real(self, w, c, g, *a))
    assert main(_study(tmp_path, "--json", "--rules", "linear,tuned", "--no-plots")) == 0
    again = json.loads(capsys.readouterr().out)
    assert calls == [] and again["runs"] == report["runs"]
    # One group lost (an interrupted study): only it retrains.
    os.remove(tmp_path / "out" / "runs" / "batch-128.json")
    assert main(_study(tmp_path, "--json", "--rules", "linear,tuned", "--no-plots")) == 0
    assert calls == [128] and json.loads(capsys.readouterr().out)["runs"] == report["runs"]
    assert main(_study(tmp_path, "--json", "--rules", "linear,tuned", "--no-plots", "--fresh")) == 0
    # Everything retrains, smallest batch first (its sweep's extensions past the edge included).
    assert calls[:2] == [128, 32] and set(calls[1:]) == {32, 128}
    capsys.readouterr()
    # Other settings in the same --out: refused, not mixed.
    assert main(_study(tmp_path, "--rules", "linear", "--no-plots", "--ref-lr", "0.2")) == 2
    assert "other settings or another spec (--ref-lr changed); pass --fresh" in capsys.readouterr().err
    # A seed added to the finished study: its runs are kept, and only the new seed's train.
    seeds = []
    monkeypatch.setattr(engine.VmapEngine, "train",
                        lambda self, w, c, g, *a: seeds.append({s for _, s in g.runs}) or real(self, w, c, g, *a))
    assert main(["study", *_study(tmp_path, "--json", "--rules", "linear,tuned", "--no-plots")[1:],
                 "--seeds", "3"]) == 0
    more = json.loads(capsys.readouterr().out)
    assert seeds and all(trained <= {2} for trained in seeds), seeds
    def trained(runs):  # each run as it trained (which is best may change with the new seed)
        return {(r["rule"], r["global_batch_size"], r["lr"], r["seed"], r["variant"], r["steps_to_target"])
                for r in runs if not r["pruned"]}

    assert trained(report["runs"]) <= trained(more["runs"]) and {r["seed"] for r in more["runs"]} == {0, 1, 2}


@pytest.mark.timeout(120)
def test_the_adascale_rule_runs_beside_the_fixed_rules(tmp_path, capsys):
    argv = _study(tmp_path, "--json", "--rules", "constant,tuned,adascale", "--global-batch-sizes", "16,32,128")
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    ada = [r for r in report["runs"] if r["rule"] == "adascale"]
    # Every run says its samples to the target: steps × its batch, for a fixed batch.
    assert all(r["samples_to_target"] == (None if r["steps_to_target"] is None
                                          else r["steps_to_target"] * r["global_batch_size"]) for r in report["runs"])
    # Only from the reference batch (32) up, one run per seed, at the reference lr, with the gain on each evaluation.
    assert sorted({r["global_batch_size"] for r in ada}) == [32, 128] and len(ada) == 4
    assert all(r["lr"] == 0.1 and r["gains"] and r["gains"][0][0] == report["eval_every"] for r in ada)
    # At the reference batch S = 1, the gain is exactly 1: AdaScale is the constant rule there, step for step.
    constant = {r["seed"]: r["steps_to_target"] for r in report["runs"]
                if r["rule"] == "constant" and r["global_batch_size"] == 32}
    assert {r["seed"]: r["steps_to_target"] for r in ada if r["global_batch_size"] == 32} == constant
    assert all(g[1] == 1.0 for r in ada if r["global_batch_size"] == 32 for g in r["gains"])
    assert all(1 <= g[1] <= 4 for r in ada if r["global_batch_size"] == 128 for g in r["gains"])
    summary = {p["global_batch_size"]: p for p in report["adascale"]}
    tuned = {p["global_batch_size"]: p["median_steps"] for p in report["tuned_lr"]}
    assert summary[128]["scale"] == 4 and summary[128]["tuned_median_steps"] == tuned[128]
    assert summary[128]["steps_over_tuned"] == pytest.approx(summary[128]["median_steps"] / tuned[128])
    assert report["trained_runs"] == len({(r["global_batch_size"], r["lr"], r["seed"], r["rule"] == "adascale")
                                          for r in report["runs"]})
    assert any(p.endswith("adascale.png") for p in report["plots"])
    with open(report["report"]) as fh:
        assert "AdaScale from the reference lr, untuned" in fh.read()
    # Its runs have a cache file of their own: a second study trains nothing.
    assert {"batch-128-adascale.json", "batch-32-adascale.json"} <= set(os.listdir(tmp_path / "out" / "runs"))
    assert main([*argv, "--no-plots"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"] == report["runs"]


@pytest.mark.timeout(120)
def test_the_ramp_rule_grows_from_the_smallest_batch_and_is_judged_against_the_tuned_runs(tmp_path, capsys):
    argv = _study(tmp_path, "--json", "--rules", "tuned,ramp", "--global-batch-sizes", "16,128")
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    ramp = [r for r in report["runs"] if r["rule"] == "ramp"]
    tuned = {p["global_batch_size"]: p for p in report["tuned_lr"]}
    # One run per seed from the smallest batch, at the best lr the sweep found there.
    assert [r["seed"] for r in ramp] == [0, 1] and {r["global_batch_size"] for r in ramp} == {16}
    assert all(r["lr"] == tuned[16]["lr"] for r in ramp)
    for run in ramp:
        batches = [t[1] for t in run["trajectory"]]
        # Whole micro-batches of 8, growing only, never past the grid's largest batch; the batch did grow.
        assert batches == sorted(batches) and all(b % 8 == 0 and 16 <= b <= 128 for b in batches) and batches[-1] > 16
        steps = run["steps_to_target"]
        assert steps is not None and 16 * steps <= run["samples_to_target"] <= 128 * steps
    summary = report["ramp"]
    assert summary["start_global_batch_size"] == 16 and summary["tuned_median_steps"] == tuned[16]["median_steps"]
    assert summary["steps_over_tuned"] == pytest.approx(summary["median_steps"] / tuned[16]["median_steps"])
    assert summary["samples_over_tuned"] == pytest.approx(summary["median_samples"] / (16 * tuned[16]["median_steps"]))
    assert "ramp" not in report["fit"] and any(p.endswith("ramp.png") for p in report["plots"])
    assert "batch-16-ramp.json" in os.listdir(tmp_path / "out" / "runs")
    # An odd smallest batch cannot be two micro-batches.
    assert main(_study(tmp_path, "--rules", "ramp", "--global-batch-sizes", "15,64", "--fresh")) == 2
    assert "the ramp starts from the smallest of --global-batch-sizes, 15: it must be even" in capsys.readouterr().err


def _accounted(report: dict, runs: list[dict], fixed: dict) -> None:
    """The schedule's accounting against the best tuned fixed run at its first batch: the median seed's phases as its
    trajectory shows them, each seed's curve at the samples its steps trained, and at the end each seed's samples
    against the fixed run's to the target (evaluated every step: within one of its steps)."""
    accounting = report["schedule_accounting"]
    assert accounting["start_global_batch_size"] == 16 and accounting["fixed_lr"] == fixed["lr"]
    middle = sorted(runs, key=lambda r: r["steps_to_target"])[(len(runs) - 1) // 2]
    at = [t[1] for t in middle["trajectory"]]
    batches = [16, *at[:-1]]  # the first step's batch, then what each evaluation says the next one's is
    rows = accounting["phases"]
    assert [r["global_batch_size"] for r in rows] == [16, 32, 64]
    assert [r["steps"] for r in rows] == [batches.count(b) for b in (16, 32, 64)]
    assert sum(r["samples"] for r in rows) == rows[-1]["end_samples"] == middle["samples_to_target"]
    assert [r["start_samples"] for r in rows[1:]] == [r["end_samples"] for r in rows[:-1]]
    assert all(r["start_samples"] >= t for r, t in zip(rows[1:], (320, 960)))
    for run, curve in zip(runs, accounting["curves"]["schedule"]):
        assert len(curve) == run["steps_to_target"] and curve[-1][0] == run["samples_to_target"]
    fixed_curves = accounting["curves"]["fixed"]["16"]["seeds"]
    lows = [run["samples_to_target"] / next(s for s, m in c if m >= report["target"]["value"])
            for run, c in zip(runs, fixed_curves)]
    highs = [run["samples_to_target"] / (next(s for s, m in c if m >= report["target"]["value"]) - 16)
             for run, c in zip(runs, fixed_curves)]
    low, high = rows[-1]["samples_ratio_range"]
    assert min(lows) <= low <= min(highs) and max(lows) <= high <= max(highs)


def _follows(run: dict, schedule: str | list, lr: float) -> int:
    """Assert the run trained at each step the batch and lr its schedule sets for the samples seen before it (every
    step evaluated), and return the samples it trained."""
    from ddplab.adapt import thresholds as th

    entries = th.parse(schedule)
    factors = th.lr_factors(entries)
    assert [t[0] for t in run["trajectory"]] == list(range(1, len(run["trajectory"]) + 1))
    seen = entries[0].global_batch_size  # the first step's batch, the schedule's first
    for step, batch, step_lr in run["trajectory"]:
        # What the trajectory records after a step: the batch and lr of the next, from the samples seen so far.
        entry = th.index_at(entries, seen)
        assert batch == entries[entry].global_batch_size
        assert step_lr == pytest.approx(lr * factors[entry], rel=1e-12)
        if step < len(run["trajectory"]):
            seen += batch
    return seen


@pytest.mark.timeout(120)
def test_the_schedule_rule_follows_its_schedule_from_scratch_beside_the_tuned_runs_and_the_ramp(tmp_path, capsys,
                                                                                                  monkeypatch):
    megatron = "0:16 320:32 960:64"
    argv = _study(tmp_path, "--json", "--rules", "tuned,ramp,schedule", "--global-batch-sizes", "16,64",
                  "--eval-every", "1", "--no-plots")
    assert main([*argv, "--schedule", megatron]) == 0
    report = json.loads(capsys.readouterr().out)
    tuned = {p["global_batch_size"]: p for p in report["tuned_lr"]}
    runs = [r for r in report["runs"] if r["rule"] == "schedule"]
    # One run per seed from the schedule's first batch; a schedule without lrs runs at the best tuned lr there.
    assert [r["seed"] for r in runs] == [0, 1] and {r["global_batch_size"] for r in runs} == {16}
    for run in runs:
        assert run["lr"] == tuned[16]["lr"] and run["steps_to_target"] is not None
        assert _follows(run, megatron, run["lr"]) == run["samples_to_target"]
        assert {t[1] for t in run["trajectory"]} == {16, 32, 64}
    adaptive = report["adaptive"]
    assert set(adaptive) == {"ramp", "schedule"}
    s_min, e_min = report["fit"]["tuned"]["s_min"], report["fit"]["tuned"]["e_min"]
    for name, summary in adaptive.items():
        own = [r for r in report["runs"] if r["rule"] == name]
        steps = statistics.median(r["steps_to_target"] for r in own)
        samples = statistics.median(r["samples_to_target"] for r in own)
        # Against the fixed-batch front: the tuned batches with strictly fewer steps and samples, and the fitted
        # front (S/S_min − 1)(E/E_min − 1) = 1 solved for E at the rule's steps.
        beaten = [b for b, p in sorted(tuned.items()) if p["median_steps"] < steps and p["median_steps"] * b < samples]
        front = e_min * (1 + 1 / (steps / s_min - 1)) if steps > s_min else None
        assert summary == {"median_steps": steps, "median_samples": samples,
                           "start_global_batch_size": 16, "fixed_median_steps": tuned[16]["median_steps"],
                           "fixed_median_samples": 16 * tuned[16]["median_steps"], "dominated_by": beaten,
                           "front_samples_at_steps": pytest.approx(front, rel=1e-12) if front else None}
    assert adaptive["ramp"]["median_steps"] == report["ramp"]["median_steps"] and "schedule" not in report["fit"]
    _accounted(report, runs, tuned[16])
    # Again as a person reads it (cached): a line per rule against the front, and the plots with their points.
    monkeypatch.setenv("COLUMNS", "400")
    assert main([*(a for a in argv if a not in ("--json", "--no-plots")), "--schedule", megatron]) == 0
    printed = capsys.readouterr().out
    for name, summary in adaptive.items():
        line = next(x for x in printed.splitlines() if x.startswith(f"{name} ("))
        assert line.startswith(f"{name} ({render.num(summary['median_steps'])} steps, "
                               f"{render.num(summary['median_samples'])} samples): ")
        beaten = ", ".join(f"{b} ({render.num(tuned[b]['median_steps'])} steps, "
                           f"{render.num(tuned[b]['median_steps'] * b)} samples)" for b in summary["dominated_by"])
        assert (f"dominated by global batch{'es' if len(summary['dominated_by']) > 1 else ''} {beaten}" in line
                if beaten else "on or below the fixed-batch front (no fixed batch reaches" in line), line
        front = summary["front_samples_at_steps"]
        side = "below" if summary["median_samples"] < front else "above"
        assert line.endswith(f"; {side} the tuned fit's front, which needs {render.num(front)} samples at "
                             f"{render.num(summary['median_steps'])} steps"), line
    out = tmp_path / "out"
    assert {"pareto.png", "ramp.png", "schedule.png", "report.html"} <= set(os.listdir(out))
    phase_lines = printed[printed.index("schedule phase by phase"):].splitlines()[1:4]
    for line, row in zip(phase_lines, report["schedule_accounting"]["phases"]):
        assert line.startswith(f"  global batch {row['global_batch_size']} at lr {row['lr']:.4g}: {row['steps']} "
                               f"steps, samples {row['start_samples']} to {row['end_samples']}; "), line
    with open(out / "report.html") as fh:
        page = fh.read()
    assert "Batches that change, against the fixed-batch front" in page
    assert "<h2>The schedule phase by phase</h2>" in page and page.count("<tr><td>") >= 3
    cached = [n for n in os.listdir(tmp_path / "out" / "runs") if n.startswith("batch-16-schedule-")]
    # A schedule with lrs, on the same grid (cached): from the best tuned lr at its first batch, each later entry at
    # its own lr (what the branches measured there), its runs cached apart.
    schedule = [{"samples_seen": 0, "global_batch_size": 16, "lr": 0.05},
                {"samples_seen": 320, "global_batch_size": 32, "lr": 0.1},
                {"samples_seen": 960, "global_batch_size": 64, "lr": 0.2}]
    path = tmp_path / "schedule.json"
    path.write_text(json.dumps(schedule))
    assert main([*argv, "--schedule", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tuned_lr"] == list(tuned.values())
    best = tuned[16]["lr"]
    followed = [{**schedule[0], "lr": best}, *schedule[1:]]
    for run in [r for r in report["runs"] if r["rule"] == "schedule"]:
        assert run["lr"] == best and _follows(run, followed, best) == run["samples_to_target"]
        assert {round(t[2], 12) for t in run["trajectory"]} <= {best, 0.1, 0.2}
        assert {t[1] for t in run["trajectory"]} == {16, 32, 64}
    assert [round(r["lr"], 12) for r in report["schedule_accounting"]["phases"]] == [best, 0.1, 0.2]
    assert len([n for n in os.listdir(tmp_path / "out" / "runs") if n.startswith("batch-16-schedule-")]) == 2
    assert len(cached) == 1
    # Refused before anything trains: no schedule, or one that starts off the grid.
    for extra, message in (([], "the schedule rule follows --schedule: give a branched.json, a schedule.json or a "
                                "Megatron-style string such as '0:32 416:64'"),
                           (["--schedule", "0:8 64:16"], "--schedule starts at global batch 8, which "
                                                         "--global-batch-sizes does not hold: add it")):
        out = tmp_path / "refused"
        assert main([*_study(tmp_path, "--rules", "tuned,schedule"), "--out", str(out), *extra]) == 2
        assert message in capsys.readouterr().err and not out.exists()


@pytest.mark.timeout(120)
def test_cli_bad_input_one_line_exit_2(tmp_path, capsys):
    cases = [
        (_study(tmp_path, "--no-plots", "--global-batch-sizes", "32,4096", "--fresh"),
         "larger than the 1438 training"),
        (_study(tmp_path, "--no-plots", "--ref-lr", "1e4", "--max-steps", "20", "--fresh"), "diverged"),
        (["study", os.path.join(SPECS, "correct.py"), "--target-accuracy", "0.9", "--no-plots", "--out",
          str(tmp_path / "spec")], "neither evaluate"),
        (["study", str(tmp_path / "no_such_spec.py")], f"spec file {tmp_path / 'no_such_spec.py'} does not exist"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    # The runs of the study that diverged stay cached.
    assert os.listdir(tmp_path / "out" / "runs")


@pytest.mark.timeout(120)
def test_an_unreached_median_says_how_many_runs_arrived(tmp_path, capsys):
    """digits' linear rule at 512 and 1024 (lr 0.1 × 16 and × 32): at 512 one seed of three arrives and two do not,
    so the best accuracy passes the target while the median missed; the line says so instead of contradicting
    itself. At 1024 none arrives and the line is as before."""
    argv = ["study", "--global-batch-sizes", "32,512,1024", "--rules", "linear", "--out", str(tmp_path / "out"),
            "--fresh", "--no-plots"]
    main(argv)
    out = " ".join(capsys.readouterr().out.split())
    assert ("rule linear at global batch 512 (1 of its 3 runs arrived, short of a median; its runs' best accuracy: "
            "0.95") in out
    assert "rule linear at global batch 1024 (its runs' best accuracy: 0.3" in out
    with open(tmp_path / "out" / "study.json") as fh:
        unreached = {m["global_batch_size"]: (m["arrived"], m["runs"]) for m in json.load(fh)["unreached"]}
    assert unreached == {512: (1, 3), 1024: (0, 3)}


@pytest.mark.timeout(120)
def test_a_target_no_run_reaches_says_how_close_each_came(tmp_path, capsys):
    argv = _study(tmp_path, "--max-steps", "10", "--target-accuracy", "0.9999", "--json", "--verify-ddp", "1")
    assert main(argv) == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert captured.err.count("\n") == 1 and "no run reached the target (accuracy 0.9999)" in captured.err
    assert report["fit"] == {} and report["tuned_lr"] == [] and report["plots"] == []
    # Every rule at every batch size is named, with the best accuracy any of its runs got (a real fraction).
    assert {(m["rule"], m["global_batch_size"]) for m in report["unreached"]} == {
        (rule, b) for rule in ("constant", "linear", "sqrt", "tuned") for b in (32, 128)}
    assert all(0 < m["best_metric"] < 0.9999 and m["arrived"] == 0 < m["runs"] for m in report["unreached"])
    # Nothing trained to the target, yet the engine's equivalence with DDP still holds on a grid point.
    assert len(report["verify_ddp"]["points"]) == 1 and report["verify_ddp"]["max_abs_diff"] < 1e-4
    with open(tmp_path / "out" / "study.json") as fh:
        assert json.load(fh)["unreached"] == report["unreached"]


@pytest.mark.timeout(60)
def test_plan_from_study(tmp_path, capsys):
    path = tmp_path / "study.json"
    path.write_text(json.dumps({"workload": "w", "fit": {"tuned": {"b_crit": 100.0}}, "train_size": 4000,
                                "tuned_lr": [{"global_batch_size": b, "lr": 0.001 * b} for b in (32, 128, 512)]}))
    argv = ["plan", "--ref-batch-size", "32", "--ref-lr", "0.05", "--devices", "8", "--batch-size", "32",
            "--from-study", str(path), "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["global_batch_size"] == 256 and plan["lr"] == pytest.approx(0.256) and plan["rule"] == "measured"
    assert (plan["steps_factor"] == pytest.approx(1 + 100 / 256)
            and plan["compute_factor"] == pytest.approx(1 + 256 / 100))
    assert "ddplab study" in plan["reasons"]["lr"]
    # Reasoned from the lr it recommends: ×5.12 over the reference's 0.05 warms up, and the warmup says so.
    assert plan["lr_multiplier"] == pytest.approx(0.256 / 0.05) and plan["warmup_recommended"]
    assert "×5.12" in plan["reasons"]["warmup_recommended"]
    # The other mode keeps the trajectory: the reference's global batch of 32 and its lr (not the study's 0.032).
    assert "(global 32) at lr 0.05" in plan["other_mode"]
    assert main(argv[:-1] + ["--devices", "32"]) == 0
    assert "outside the study's measured range" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_plan_from_study_refuses_what_the_study_cannot_answer(tmp_path, capsys):
    path = tmp_path / "study.json"
    path.write_text(json.dumps({"workload": "w", "fit": {"tuned": {"b_crit": 100.0}}, "train_size": 4000,
                                "tuned_lr": [{"global_batch_size": b, "lr": 0.001 * b} for b in (32, 128, 512)]}))
    base = ["plan", "--ref-batch-size", "32", "--ref-lr", "0.05", "--devices", "8", "--from-study", str(path)]
    # A measured lr of 2× the reference needs no warmup, whatever the global batch grew by.
    assert main([*base, "--batch-size", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["global_batch_size"] == 64 and plan["lr"] == pytest.approx(0.064) and not plan["warmup_recommended"]
    for extra, message in ((["--critical-batch-size", "500"], "--critical-batch-size and --from-study both give"),
                           (["--optimizer", "adamw"], "the study measured the best lr of SGD"),
                           (["--rule", "sqrt"], "--rule sqrt and --from-study both choose the lr")):
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
    # A global batch larger than the study's training set: the study never took such a step, and the plan says so.
    assert main([*base, "--batch-size", "1024", "--nodes", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["global_batch_size"] == 32768 and any("larger than the study's 4000 training samples" in w
                                                       for w in plan["warnings"])
    # A reference lr far from what the study found best at the reference's own batch (0.032): said, not hidden.
    for ref_lr, warned in (("0.05", False), ("0.5", True)):
        assert main([*base, "--ref-lr", ref_lr, "--json"]) == 0
        warnings = json.loads(capsys.readouterr().out)["warnings"]
        assert any("the study's best lr at the reference's global batch 32 is 0.032, 15.6× away from --ref-lr 0.5"
                   in w for w in warnings) == warned


def test_spec_evaluate_agrees_with_vectorized_validation():
    path = os.path.join(SPECS, "study_eval.py")
    with_evaluate = workloads.from_spec(path)
    vectorized = dataclasses.replace(with_evaluate, evaluate=None, val=with_evaluate.eval_dataset.tensors)
    config = StudyConfig(target=Target(kind="accuracy", value=0.9), global_batch_sizes=(32, 64))
    runs = [(0.05, 0), (0.2, 1)]
    a = engine.train_group(with_evaluate, config, grid_group(config, 32, runs))
    b = engine.train_group(vectorized, config, grid_group(config, 32, runs))
    assert [r.steps_to_target for r in a] == [r.steps_to_target for r in b]
    assert all(r.steps_to_target is not None for r in a)
    assert [h[2] for h in a[0].history] == pytest.approx([h[2] for h in b[0].history], abs=1e-6)


@pytest.mark.parametrize("seeds", [2, 3])
def test_pruning_slow_sweep_lrs_keeps_the_best(seeds):
    workload = workloads.regression(dim=8, n_train=1024, n_val=512)
    start = float(workload.val[1].pow(2).mean())
    config = StudyConfig(target=Target(kind="loss", value=start * 0.05), optimizer=PLAIN_SGD, seeds=seeds,
                               global_batch_sizes=(16, 32), max_steps=120, eval_every=2, dtype="float64")
    runs = [(lr, s) for lr in (0.01, 0.04, 0.16) for s in range(seeds)]
    full = engine.train_group(workload, config, grid_group(config, 16, runs))
    sweep_only = frozenset({(0.01, ""), (0.04, ""), (0.16, "")})
    pruned = engine.train_group(workload, config, grid_group(config, 16, runs, sweep_only=sweep_only))

    def best(results):
        return study_fit.best_lr({lr: [r.steps_to_target or math.inf for r in results if r.lr == lr]
                                  for lr, _ in runs})

    assert best(full) == best(pruned)
    assert any(r.pruned for r in pruned) and not any(r.pruned for r in full)
    assert [r.steps_to_target for r in full if r.lr == best(full)[0]] == \
        [r.steps_to_target for r in pruned if r.lr == best(full)[0]]


def test_missing_extras_say_what_to_install(monkeypatch, capsys, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    assert main(["study", "--no-plots", "--out", str(tmp_path)]) == 2
    assert "pip install 'ddplab[study]'" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "mnist1d", None)
    monkeypatch.setitem(sys.modules, "mnist1d.data", None)
    assert main(["study", "--workload", "mnist1d", "--no-plots", "--out", str(tmp_path)]) == 2
    assert "the mnist1d workload needs the mnist1d package: pip install 'ddplab[study]'" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["study", "--out", str(tmp_path)]) == 2
    assert "pip install 'ddplab[study]'" in capsys.readouterr().err
    # Branches too, before the reference run trains.
    assert main(["study", "--workload", "regression", "--branch-at", "0.5", "--out", str(tmp_path / "branched")]) == 2
    assert "plots need matplotlib: pip install 'ddplab[study]' (or --no-plots)" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "branched" / "branched.json")


def test_the_built_in_workloads_bring_their_documented_settings():
    """mnist1d is built offline and leaves the process's random generators as they were; charlm's windows predict
    the next character; each workload's documented target, grid and optimizer come with it."""
    import random

    import numpy

    from ddplab.study.workloads import workload_defaults

    random.seed(7)
    numpy.random.seed(7)
    expected = random.random(), numpy.random.random()
    random.seed(7)
    numpy.random.seed(7)
    mnist = workloads.load(("mnist1d", ()))
    assert (random.random(), numpy.random.random()) == expected
    assert mnist.train[0].shape == (4000, 40) and mnist.val[0].shape == (1000, 40)
    assert sorted(mnist.train[1].unique().tolist()) == list(range(10))
    assert workload_defaults(mnist)["target"] == Target(kind="accuracy", value=0.6)
    lm = workloads.load(("charlm", ()))
    inputs, targets = lm.train
    assert inputs.shape[1] == workloads.CHARLM_CONTEXT and torch.equal(inputs[1:, -1], targets[:-1, -1])
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    defaults = workload_defaults(lm)
    assert defaults["optimizer"].family == "adamw" and defaults["target"] == Target(kind="loss", value=2.1)
    output = lm.model()(inputs[:4])
    assert output.shape == (4, workloads.CHARLM_CONTEXT, output.shape[-1])
    # Causal: changing the last character changes no earlier position's prediction.
    model = lm.model().eval()
    changed = inputs[:1].clone()
    changed[0, -1] = (changed[0, -1] + 1) % output.shape[-1]
    with torch.no_grad():
        assert torch.equal(model(inputs[:1])[0, :-1], model(changed)[0, :-1])


def test_evaluate_that_raises_is_one_line_and_a_failed_start_leaves_no_fingerprint(tmp_path, capsys):
    broken = tmp_path / "broken_eval.py"
    with open(os.path.join(SPECS, "study_eval.py")) as fh:
        source = fh.read()
    broken.write_text(source.replace("x, y = dataset.tensors", "x, y = dataset.tensors[0], {'labels': 1}['label']"))
    out = str(tmp_path / "out")
    assert main(["study", str(broken), "--target-accuracy", "0.9", "--global-batch-sizes", "16,32", "--seeds", "1",
                 "--no-plots", "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "broken_eval.py: evaluate(model, dataset) raised KeyError: 'label'" in err
    # The same on the DDP engine, where rank 0 evaluates: the rank's error comes back as that line.
    assert main(["study", str(broken), "--target-accuracy", "0.9", "--global-batch-sizes", "16,32", "--seeds", "1",
                 "--no-plots", "--engine", "ddp", "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "evaluate(model, dataset) raised KeyError: 'label' (on rank 0)" in err
    # Nothing was trained there, so another study may use the same --out.
    assert main(["study", str(broken.with_name("fixed.py")), "--target-accuracy", "0.9"]) == 2
    capsys.readouterr()
    fixed = tmp_path / "fixed.py"
    with open(os.path.join(SPECS, "study_eval.py")) as fh:
        fixed.write_text(fh.read())
    assert main(["study", str(fixed), "--target-accuracy", "0.8", "--global-batch-sizes", "16,32", "--seeds", "1",
                 "--max-steps", "40", "--no-plots", "--out", out]) in (0, 1)
    assert "other settings" not in capsys.readouterr().err
    # A changed spec with the same name is a changed study: its cache is refused, not reused.
    fixed.write_text(fixed.read_text().replace("torch.nn.Linear(6, 16)", "torch.nn.Linear(6, 32)").replace(
        "torch.nn.Linear(16, 2)", "torch.nn.Linear(32, 2)"))
    assert main(["study", str(fixed), "--target-accuracy", "0.8", "--global-batch-sizes", "16,32", "--seeds", "1",
                 "--max-steps", "40", "--no-plots", "--out", out]) == 2
    assert "other settings or another spec (the spec file or workload changed); pass --fresh" in capsys.readouterr().err


def test_output_folders_are_checked_before_any_run(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for out, message in ((a_file, "is a file"), (a_file / "below", "is not writable"),
                         ("/proc/no-such-place", "is not writable")):
        assert main(["study", "--out", str(out), "--no-plots"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err and "--out" in err
    (tmp_path / "corrupt" / "runs").mkdir(parents=True)
    (tmp_path / "corrupt" / "runs" / "batch-32.json").write_text("[{\"lr\": 0.1, ")
    (tmp_path / "corrupt" / "config.json").write_text("{}")
    assert main(_study(tmp_path, "--no-plots", "--out", str(tmp_path / "corrupt"))) == 2
    err = capsys.readouterr().err
    assert "batch-32.json cannot be read" in err and "--fresh" in err


@pytest.mark.timeout(180)
def test_a_spec_with_adamw_dropout_and_layernorm_runs_end_to_end(tmp_path, capsys):
    """The spec's own AdamW (its lr the reference, its betas and weight decay kept), the adam-sqrt rule with
    plan's betas and eps, dropout and LayerNorm in the vectorized group, plots, and plan --from-study."""
    spec = os.path.join(SPECS, "study_adamw.py")
    argv = ["study", spec, "--target-accuracy", "0.9", "--global-batch-sizes", "16,64", "--seeds", "2",
            "--max-steps", "300", "--out", str(tmp_path / "out"), "--engine", "vmap", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["optimizer"] == {"family": "adamw", "name": "AdamW", "betas": [0.9, 0.98], "eps": 1e-8,
                                   "weight_decay": 0.05}
    # The reference batch 32 is not trained here: the rules scale from the spec's lr, and a warning says why.
    assert report["engine"] == "vmap" and report["reference"] == {
        "global_batch_size": 32, "lr": 3e-3, "rules_lr": {"lr": 3e-3, "source": "reference_lr"}}
    assert any("the reference batch 32 is not among the global batch sizes" in w for w in report["warnings"])
    assert report["rules"] == ["constant", "linear", "sqrt", "adam-sqrt", "tuned"]
    # k = 2 at batch 64: 1 − β' = 2(1 − β), ε' = ε/√2, lr × √2 (plan's numbers).
    at_64 = next(p for p in report["adam_sqrt"] if p["global_batch_size"] == 64)
    assert at_64["betas"] == pytest.approx([0.8, 0.96]) and at_64["eps"] == pytest.approx(1e-8 / math.sqrt(2))
    assert at_64["lr"] == pytest.approx(3e-3 * math.sqrt(2))
    assert {r["rule"] for r in report["runs"]} == set(report["rules"])
    assert report["fit"]["tuned"]["b_crit"] is not None
    assert any(p.endswith("pareto.png") for p in report["plots"])
    # Flags override single settings of the spec's optimizer, and another family's flags are refused.
    assert main([*argv, "--no-plots", "--weight-decay", "0.01", "--betas", "0.9,0.95", "--fresh"]) == 0
    assert json.loads(capsys.readouterr().out)["optimizer"]["betas"] == [0.9, 0.95]
    assert main([*argv, "--momentum", "0.5"]) == 2
    assert "--momentum changes nothing for adamw" in capsys.readouterr().err
    # Beside an SGD study: both best lrs per batch, each with its rule (the cache serves: nothing retrains).
    sgd = tmp_path / "sgd.json"
    sgd.write_text(json.dumps({"workload": "w", "optimizer": {"family": "sgd", "name": "SGD"},
                               "reference": {"global_batch_size": 32, "lr": 0.1}, "global_batch_sizes": [16, 64],
                               "tuned_lr": [{"global_batch_size": 16, "lr": 0.05}, {"global_batch_size": 64,
                                                                                   "lr": 0.2}]}))
    assert main([*argv, "--weight-decay", "0.01", "--betas", "0.9,0.95", "--compare", str(sgd)]) == 0
    assert any(p.endswith("compare_lr.png") for p in json.loads(capsys.readouterr().out)["plots"])
    assert main([*argv, "--compare", str(tmp_path / "missing.json")]) == 2
    assert "--compare" in capsys.readouterr().err
    # plan --from-study takes an AdamW study for AdamW (and Adam, and when no --optimizer is given: the study's), and
    # refuses it for SGD.
    plan = ["plan", "--ref-batch-size", "16", "--ref-lr", "3e-3", "--devices", "4", "--batch-size", "16",
            "--from-study", str(tmp_path / "out" / "study.json")]
    for optimizer in (["--optimizer", "adamw"], []):
        assert main([*plan, *optimizer, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["rule"] == "measured" and out["betas"] == [0.9, 0.95]
    assert main([*plan, "--optimizer", "sgd"]) == 2
    assert "the study measured the best lr of AdamW" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_rules_are_judged_against_the_optimizer_the_spec_trains(tmp_path, capsys):
    """Adam's rules named with --rules are accepted for a spec whose optimizer() is AdamW (no --optimizer needed),
    and refused, naming the optimizer, for a spec whose optimizer() is SGD or Adam."""
    spec = os.path.join(SPECS, "study_adamw.py")
    argv = ["study", spec, "--target-accuracy", "0.9", "--global-batch-sizes", "32,64", "--seeds", "1",
            "--max-steps", "10", "--rules", "tuned,sqrt,adam-sqrt,surge,adamw-tau", "--engine", "vmap", "--no-plots",
            "--out", str(tmp_path / "out"), "--json"]
    assert main(argv) in (0, 1)
    report = json.loads(capsys.readouterr().out)
    assert report["optimizer"]["name"] == "AdamW"
    assert report["rules"] == ["tuned", "sqrt", "adam-sqrt", "surge", "adamw-tau"]
    text = open(spec).read()
    for optimizer, rule, needs in (("torch.optim.SGD(params, lr=0.1)", "adam-sqrt", "adam or adamw"),
                                   ("torch.optim.Adam(params, lr=3e-3)", "adamw-tau", "adamw")):
        other = tmp_path / f"{rule}.py"
        other.write_text(text.replace("torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.98), weight_decay=0.05)",
                                      optimizer))
        assert main(["study", str(other), "--target-accuracy", "0.9", "--rules", f"tuned,{rule}", "--no-plots",
                     "--out", str(tmp_path / rule)]) == 2
        err = capsys.readouterr().err
        name = optimizer.split("(")[0].split(".")[-1]
        assert f"the study trains {name}: it needs --optimizer {needs}" in err, err


@pytest.mark.timeout(180)
def test_the_rules_scale_from_the_tuned_best_at_the_reference_batch_unless_an_lr_is_given(tmp_path, capsys):
    """By default every rule's lr is the best tuned lr at the reference batch × its factor, the other batches'
    sweeps are laid out around it, and the output says so; --ref-lr keeps the user's lr for the rules."""
    spec = os.path.join(SPECS, "study_adamw.py")
    argv = ["study", spec, "--target-accuracy", "0.9", "--global-batch-sizes", "32,64", "--seeds", "1",
            "--max-steps", "200", "--rules", "tuned,constant,sqrt,adam-sqrt,adamw-tau", "--engine", "vmap",
            "--no-plots", "--out", str(tmp_path / "out")]

    def rule_lrs(report: dict, batch: int) -> dict[str, float]:
        return {r["rule"]: r["lr"] for r in report["runs"] if r["global_batch_size"] == batch and r["rule"] != "tuned"}

    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    best = next(p["lr"] for p in report["tuned_lr"] if p["global_batch_size"] == 32)
    # The spec's lr 3e-3 is not the study's best at its reference batch: the case where the two differ.
    assert best != 3e-3 and report["reference"] == {
        "global_batch_size": 32, "lr": 3e-3, "rules_lr": {"lr": best, "source": "best_at_reference"}}
    factor = {"constant": 1.0, "sqrt": math.sqrt(2), "adam-sqrt": math.sqrt(2), "adamw-tau": math.sqrt(2)}
    assert rule_lrs(report, 64) == pytest.approx({rule: best * f for rule, f in factor.items()})
    assert rule_lrs(report, 32) == pytest.approx({rule: best for rule in factor})
    assert main(argv) == 0
    assert (f"the rules scale from lr {best:.4g}, the best tuned lr at the reference batch 32, not the reference lr "
            "0.003") in " ".join(capsys.readouterr().out.split())
    assert main([*argv, "--ref-lr", "3e-3", "--json"]) == 0
    given = json.loads(capsys.readouterr().out)
    assert given["reference"]["rules_lr"] == {"lr": 3e-3, "source": "given"}
    assert rule_lrs(given, 64) == pytest.approx({rule: 3e-3 * f for rule, f in factor.items()})
    # The sweep at the reference batch is the same; at 64 it spans the rules' lrs from either.
    assert report["tuned_lr"][0]["sweep"] == given["tuned_lr"][0]["sweep"]
    for found in (report, given):
        sweep = found["tuned_lr"][1]["sweep"]
        assert all(sweep[0] <= lr <= sweep[-1] for lr in rule_lrs(found, 64).values())


def test_a_sweep_whose_best_lr_is_on_its_edge_extends_until_it_is_interior():
    """Noiseless regression, SGD without momentum, a sweep far below the best lr: runs are added a factor at a time
    until the best is interior, each addition cached with the rest; a budget too small for that leaves the warning."""
    workload = workloads.regression(dim=8, n_train=1024, n_val=512)
    start = float(workload.val[1].pow(2).mean())
    config = StudyConfig(target=Target(kind="loss", value=start * 0.05), global_batch_sizes=(16, 64),
                         rules=("tuned",), reference_global_batch_size=16, reference_lr=0.01, sweep_margin=1,
                         optimizer=PLAIN_SGD, seeds=2, max_steps=400, eval_every=2, dtype="float64")
    found = analysis.analyze(config, grid_training.run_grid(workload, config, None, engine.VmapEngine()))
    for point in found.tuned_lr:
        assert point["sweep"][0] < point["lr"] < point["sweep"][-1], point
        # The exact recursion's best lr (1 / (2(1 + (dim + 1)/B))) lies within a sweep factor of the one found.
        exact = 1 / (2 * (1 + 9 / point["global_batch_size"]))
        assert exact / 2 <= point["lr"] <= exact * 2, (point, exact)
    assert any(r["extension"] for r in found.runs) and not any("sits at the edge" in w for w in found.warnings)
    grid_runs = sum(len(sweep.grid_runs(config, b)) for b in config.global_batch_sizes)
    tight = dataclasses.replace(config, max_runs=grid_runs + 2)
    found = analysis.analyze(tight, grid_training.run_grid(workload, tight, None, engine.VmapEngine()))
    assert any("sits at the edge of its sweep" in w and "--max-runs" in w for w in found.warnings)
    with pytest.raises(UsageError, match=f"the grid has {grid_runs} fixed-lr runs, more than max_runs"):
        grid_training.run_grid(workload, dataclasses.replace(config, max_runs=grid_runs - 1), None, engine.VmapEngine())


def test_a_fit_that_misses_its_points_or_sits_on_its_interval_edge_is_said():
    batches = [8, 32, 128, 512]
    exact = {b: [100.0 * (1 + 64 / b)] * 3 for b in batches}
    fitted = study_fit.fit_seeds(exact)
    assert analysis._fit_warnings("tuned", fitted) == []
    bent = {**exact, 128: [400.0] * 3}
    assert any("misses the median at global batch" in w for w in analysis._fit_warnings("tuned",
                                                                                          study_fit.fit_seeds(bent)))
    on_edge = {**fitted, "b_crit_ci95": [fitted["b_crit"], fitted["b_crit"] * 2]}
    assert any("sits on the edge of its 95% interval" in w for w in analysis._fit_warnings("tuned", on_edge))


def test_a_group_too_big_for_memory_splits_and_a_run_too_big_is_refused(monkeypatch):
    """The footprint is measured (parameters, gradients, state, batch, saved activations); a group splits into parts
    that fit, and trains as the whole group would (float64, no pruning); one run that cannot fit is refused."""
    from ddplab.runtime import capacity

    workload = workloads.regression(dim=8, n_train=256, n_val=64)
    config = StudyConfig(target=Target(kind="loss", value=1e-4), global_batch_sizes=(16, 32), max_steps=60,
                         dtype="float64")
    per_run = engine.run_footprint(workload, config, 16)
    # The linear model's weight (8 doubles), its gradient and momentum, 16 inputs and targets, and the saved input.
    assert per_run >= 8 * 8 * 3 + 16 * 9 * 8 + 16 * 8 * 8
    runs = [(lr, seed) for lr in (0.01, 0.03, 0.1) for seed in range(2)]
    whole = engine.train_group(workload, config, grid_group(config, 16, runs))
    monkeypatch.setattr(capacity, "available_bytes", lambda: int(4 * per_run / capacity.SAFETY))
    assert engine.runs_that_fit(workload, config, 16) == 2
    parts = engine.train_group(workload, config, grid_group(config, 16, runs))
    assert [(r.lr, r.seed, r.steps_to_target, r.history) for r in parts] == \
        [(r.lr, r.seed, r.steps_to_target, r.history) for r in whole]
    monkeypatch.setattr(capacity, "available_bytes", lambda: per_run)
    with pytest.raises(UsageError, match="one run at global batch 16 needs about"):
        engine.train_group(workload, config, grid_group(config, 16, runs))


def test_a_target_reached_too_early_ends_with_a_warning_only_on_its_evidence(tmp_path):
    # Regression at 0.8 of its starting loss: every run is there at the first evaluation.
    workload = workloads.regression(dim=8, n_train=512, n_val=128)
    start = float(workload.val[1].pow(2).mean())
    config = StudyConfig(target=Target(kind="loss", value=start * 0.8), global_batch_sizes=(16, 64), seeds=3,
                         rules=("constant", "tuned"), reference_global_batch_size=16, reference_lr=0.02,
                         optimizer=OptimizerConfig(family="adamw"), max_steps=300, sweep_margin=2.0, dtype="float64")
    found = analysis.analyze(config, grid_training.run_grid(workload, config, None, engine.VmapEngine()))
    assert found.warnings[-1].startswith("the target is reached too early to measure the steps to it: median runs "
                                         "reached it at the first evaluation (step 5) at global batch 16, 64")
    assert found.warnings[-1].endswith("Raise the target (a lower --target-loss), or evaluate more often "
                                       "(--eval-every below 5)")
    # Zero-width intervals and 2-point curves past the first evaluation (B_crit 6.2227 [6.2227, 6.2227]).
    steps = {"tuned": {16: [40.0, 40.0, 40.0], 64: [15.0, 15.0, 15.0]},
             "sqrt": {16: [40.0, 40.0, 40.0], 64: [20.0, 20.0, 20.0]}}
    fits, _ = analysis._fits(steps)
    assert all(fitted["b_crit_ci95"][0] == fitted["b_crit_ci95"][1] for fitted in fits.values())
    [early] = analysis._early_target_warnings(config, fits, steps)
    assert "every B_crit 95% interval has zero width" in early and "each curve has 2 points" in early
    assert "first evaluation" not in early
    # No evidence, no warning: seeds that differ somewhere, or one seed, which has nothing to resample.
    spread = {**steps, "sqrt": {16: [35.0, 40.0, 45.0], 64: [20.0, 20.0, 25.0]}}
    assert analysis._early_target_warnings(config, analysis._fits(spread)[0], spread) == []
    one = {rule: {b: seeds[:1] for b, seeds in by_batch.items()} for rule, by_batch in steps.items()}
    assert analysis._early_target_warnings(config, analysis._fits(one)[0], one) == []


def test_a_flat_fit_is_undefined_and_a_b_simple_that_zero_or_infinity_fits_gives_no_ratio():
    from ddplab.study.runs import RunResult

    fits, warnings = analysis._fits({"adascale": {16: [40.0, 40.0, 40.0], 64: [40.0, 41.0, 40.0]},
                                     "tuned": {16: [80.0, 80.0, 80.0], 64: [35.0, 35.0, 35.0]}})
    assert fits["adascale"]["b_crit"] == 0 and fits["adascale"]["undefined"] == "steps do not fall as the batch grows"
    assert any("rule adascale: its median steps do not fall" in w and "undefined" in w for w in warnings)
    assert fits["tuned"]["b_crit"] == pytest.approx(48) and "undefined" not in fits["tuned"]
    # The table says so rather than print B_crit 0 and E_min 0.
    from ddplab.cli.study import _fit_row

    assert _fit_row("adascale", fits["adascale"])[2:] == ["undefined", "(steps do not fall as the batch grows)",
                                                         "undefined"]
    assert _fit_row("tuned", fits["tuned"])[2] == "48"

    def runs(g2s, traces):
        return [RunResult(global_batch_size=16, lr=0.1, seed=0, noise_g2=g2s, noise_trace=traces)]

    # |G|² measured at 2 or -1.5 alternately: B_simple's interval reaches infinity, so no ratio.
    noisy = analysis._b_simple(runs([2, -1.5] * 4, [10] * 8), {"b_crit": 100.0})
    assert noisy["value"] == pytest.approx(40) and noisy["ci95"][1] == math.inf
    assert noisy["b_crit_over_b_simple"] is None
    firm = analysis._b_simple(runs([1, 1.1, 0.9, 1, 1.05, 0.95, 1, 1], [10, 11, 9, 10, 10, 10, 10, 10]),
                              {"b_crit": 100.0})
    assert firm["b_crit_over_b_simple"] == pytest.approx(10)
