"""Study rules as values: a new rule is one class and one registration, and the grid, the engines, the cache and
the analysis take it without another change. The first rule here is a test-only one (Adam with a cube-root lr),
written as a user of the registry would, in this file alone; adamw-tau, surge and the tuned sweep's Adam variants are
real rules, tested below."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from ddplab.errors import UsageError
from ddplab.plan import scaling
from ddplab.study import optim, workloads
from ddplab.study.config import OptimizerConfig, StudyConfig, Target
from ddplab.study.engines import vmap
from ddplab.study.grid import analysis
from ddplab.study.grid import cache as grid_cache
from ddplab.study.grid import training as grid_training
from ddplab.study.report import figures as report_figures
from ddplab.study.report.records import StudyReport
from ddplab.study.rules import registry, sweep
from ddplab.study.rules.base import GridRule, OwnGroupRule, round_lr
from ddplab.study.runs import grid_group


class AdamCbrt(OwnGroupRule):
    """lr × k^(1/3) with β₂' = β₂^k (a rule no paper proposes: it only has to be a rule)."""

    name = "adam-cbrt"
    summary = "lr × k^(1/3) with β₂' = β₂^k"
    adam_only = True

    def check(self, config: StudyConfig) -> None:
        if not config.optimizer.adam:
            raise UsageError("the adam-cbrt rule scales Adam's β₂: it needs {optimizer.family} adam or adamw")

    def runs(self, config: StudyConfig, global_batch: int) -> list[tuple[float, int]]:
        k = global_batch / config.reference_global_batch_size
        return [(round_lr(config.reference_lr * k ** (1 / 3)), seed) for seed in range(config.seeds)]

    def optimizer(self, config: StudyConfig, global_batch: int) -> OptimizerConfig:
        k = global_batch / config.reference_global_batch_size
        beta1, beta2 = config.optimizer.betas
        return dataclasses.replace(config.optimizer, betas=(beta1, beta2 ** k))


@pytest.fixture
def adam_cbrt(monkeypatch):
    rule = AdamCbrt()
    monkeypatch.setitem(registry.known(), rule.name, rule)
    return rule


def _config(**fields) -> StudyConfig:
    return StudyConfig(**{"target": Target(kind="loss", value=0.05), "global_batch_sizes": (16, 64),
                          "rules": ("tuned", "adam-cbrt"), "reference_global_batch_size": 16, "reference_lr": 0.02,
                          "optimizer": OptimizerConfig(family="adamw", weight_decay=0.1), "seeds": 2,
                          "max_steps": 300, "dtype": "float64", "sweep_margin": 2.0, **fields})


def test_a_rule_registered_in_one_file_trains_caches_and_is_fitted(adam_cbrt, tmp_path):
    workload = workloads.regression(dim=8, n_train=512, n_val=128)
    config = _config()
    cache = grid_cache.Cache(str(tmp_path), config.fingerprint(workload.fingerprint), fresh=False)
    results = grid_training.run_grid(workload, config, cache, vmap.VmapEngine())
    for b in config.global_batch_sizes:
        own = [r for r in results[b] if r.rule == "adam-cbrt"]
        assert [(r.lr, r.seed) for r in own] == adam_cbrt.runs(config, b)
        assert all(r.optimizer["betas"] == list(adam_cbrt.optimizer(config, b).betas) for r in own)
    # Its group's cache file is named for it; a second study reads it back and trains nothing.
    assert {"batch-16-adam-cbrt.json", "batch-64-adam-cbrt.json"} <= set(os.listdir(tmp_path / "runs"))
    again = grid_training.run_grid(workload, config, cache, _NoTraining())
    assert {b: [r.to_json() for r in rs] for b, rs in again.items()} == \
        {b: [r.to_json() for r in rs] for b, rs in results.items()}
    found = analysis.analyze(config, results)
    assert set(found.steps_by_rule) == {"tuned", "adam-cbrt"}
    assert all(len(steps) == config.seeds for steps in found.steps_by_rule["adam-cbrt"].values())
    assert {r["rule"] for r in found.runs} == {"tuned", "adam-cbrt"}
    assert set(found.scorecard) == {"tuned", "adam-cbrt"}
    report = StudyReport(workload=workload.name, config=config, train_size=workload.train_size, analysis=found,
                         out=str(tmp_path)).to_json()
    # Every run counted once: the grid's (its sweep's extensions too), and each of the rule's own.
    assert report["trained_runs"] == sum(len(rs) for rs in results.values())
    assert sum(r.rule == "adam-cbrt" for rs in results.values() for r in rs) == 2 * config.seeds
    # Its runs are drawn in every plot, in a colour of its own.

    assert report_figures.color("adam-cbrt") not in {report_figures.color(name) for name in registry.known()
                                                     if name != "adam-cbrt"}
    assert all(os.path.getsize(path) for path in report_figures.plots(report, results, str(tmp_path)))
    with pytest.raises(UsageError, match="adam-cbrt rule scales Adam"):
        _config(optimizer=OptimizerConfig(family="sgd"))


def test_the_vectorized_engine_trains_each_run_with_its_own_settings_as_torch_adamw():
    """One vectorized group of runs with the study's, adam-sqrt's and adamw-tau's settings (the tuned sweep's
    variants): each run's weights after 12 steps are those of torch.optim.AdamW alone with that run's settings."""
    workload = workloads.regression(dim=8, n_train=512, n_val=128)
    config = _config(rules=("tuned", "adam-sqrt", "adamw-tau"), optimizer=OptimizerConfig(family="adamw",
                                                                                          weight_decay=0.1))
    b, steps = 64, 12
    variants = sweep.variants(config, b)
    assert set(variants) == {"adam-sqrt", "adamw-tau"}
    assert variants["adamw-tau"].weight_decay == pytest.approx(0.2)
    group = grid_group(config, b, [(0.02, 0, ""), (0.02, 1, "adam-sqrt"), (0.04, 1, "adamw-tau")], variants)
    trained = vmap.Group(workload, config, group)
    for step in range(steps):
        trained.step(step, measure=False)
    inputs, targets = workload.train
    for row, ((lr, seed), settings) in enumerate(zip(group.runs, group.run_optimizers())):
        model = workload.model().to(torch.float64)
        model.load_state_dict(vmap.seeded_state(workload, seed, torch.float64)[0])
        optimizer = optim.torch_optimizer(settings, model.parameters(), lr)
        assert isinstance(optimizer, torch.optim.AdamW)
        order = vmap.Batches(workload.train_size, b, [seed])
        for step in range(steps):
            index = order.indices(step)[0]
            optimizer.zero_grad()
            workload.loss(model(inputs[index].to(torch.float64)), targets[index].to(torch.float64)).backward()
            optimizer.step()
        for name, param in model.named_parameters():
            torch.testing.assert_close(trained.params[name][row], param.detach(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("family", ["adamw", "adam"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_stacked_update_is_torch_optims_bit_for_bit_with_per_run_settings(family, dtype):
    """Given the same gradients, every run of a stacked group (its own lr, betas, eps and weight decay) ends bit for
    bit where torch.optim's Adam or AdamW takes that run alone: the same operations in the same order, every scalar
    computed in Python floats and rounded once."""
    torch.manual_seed(0)
    shapes = [(64, 33), (17,), (1,), (5, 3)]
    settings = [OptimizerConfig(family=family, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
                OptimizerConfig(family=family, betas=(0.8, 0.99), eps=5e-9, weight_decay=0.0),
                OptimizerConfig(family=family, betas=(0.95, 0.999 ** 4), eps=1e-7, weight_decay=0.37)]
    lrs = [1e-3, 3e-3, 2e-2]
    params = {f"p{i}": torch.randn(len(lrs), *shape, dtype=dtype) for i, shape in enumerate(shapes)}
    alone = [[params[n][row].clone() for n in params] for row in range(len(lrs))]
    optimizers = [optim.torch_optimizer(s, ps, lr) for s, ps, lr in zip(settings, alone, lrs)]
    stacked = optim.stacked(settings, params)
    lr = torch.tensor(lrs, dtype=torch.float64)
    for _ in range(30):
        grads = {n: torch.randn_like(p) for n, p in params.items()}
        for row, optimizer in enumerate(optimizers):
            for tensor, name in zip(alone[row], params):
                tensor.grad = grads[name][row].clone()
            optimizer.step()
        stacked.step(params, grads, lr)
    for row in range(len(lrs)):
        for tensor, name in zip(alone[row], params):
            assert torch.equal(params[name][row], tensor), (row, name)
    # A run that stops leaves the others their settings and state: they go on as torch.optim's.
    kept = [2, 0]
    stacked.keep(torch.tensor(kept), kept)
    assert stacked.configs == [settings[2], settings[0]]
    params = {n: p[kept].clone() for n, p in params.items()}
    for _ in range(5):
        grads = {n: torch.randn_like(p) for n, p in params.items()}
        for row, run in enumerate(kept):
            for tensor, name in zip(alone[run], params):
                tensor.grad = grads[name][row].clone()
            optimizers[run].step()
        stacked.step(params, grads, lr[kept])
    for row, run in enumerate(kept):
        for tensor, name in zip(alone[run], params):
            assert torch.equal(params[name][row], tensor), (run, name)


def test_adamw_tau_scales_every_setting_as_ddplab_plan_does():
    config = _config(rules=("tuned", "adamw-tau"), optimizer=OptimizerConfig(family="adamw", betas=(0.9, 0.99),
                                                                            weight_decay=0.1))
    rule = registry.get("adamw-tau")
    assert rule.runs(config, 64) == [(0.04, 0), (0.04, 1)]
    scaled = rule.optimizer(config, 64)
    # k = 4: β₁ kept, β₂ at a constant half-life (β₂⁴), ε/√k, λ·k·(η/η') = λ√k: plan's own functions.
    assert scaled.betas == (0.9, 0.99 ** 4) == scaling.adam_betas(4, (0.9, 0.99))
    assert scaled.eps == 5e-9 and scaled.weight_decay == pytest.approx(0.2)
    assert rule.variant(config, 16) is None and rule.variant(config, 64) == scaled
    # The timescale 1/(η·λ) in samples and β₂'s half-life in samples are the reference's at every batch.
    rows = rule.report(config, {}, [])["adamw_tau"]
    assert [r["timescale_samples"] for r in rows] == pytest.approx([16 / (0.02 * 0.1)] * 2)
    assert [r["beta2_half_life_samples"] for r in rows] == pytest.approx([scaling.half_life_steps(0.99) * 16] * 2)
    with pytest.raises(UsageError, match="adamw-tau rule scales AdamW"):
        _config(rules=("adamw-tau",), optimizer=OptimizerConfig(family="adam"))


def test_the_tuned_sweep_trains_every_lr_with_each_adam_rules_settings():
    config = _config(rules=("constant", "adam-sqrt", "adamw-tau", "surge", "tuned"), noise_scale=100.0,
                     optimizer=OptimizerConfig(family="adamw", weight_decay=0.1))
    swept = registry.get("tuned").grid_lrs(config, 64)
    # At the reference nothing is scaled: one setting per lr.
    assert sweep.variants(config, 16) == {}
    assert {v for _, _, v in sweep.grid_runs(config, 16)} == {""}
    variants = sweep.variants(config, 64)
    assert variants == {"adam-sqrt": registry.get("adam-sqrt").optimizer(config, 64),
                        "adamw-tau": registry.get("adamw-tau").optimizer(config, 64)}
    runs = sweep.grid_runs(config, 64)
    assert {(lr, seed, v) for lr in swept for seed in range(2) for v in ("", "adam-sqrt", "adamw-tau")} <= set(runs)
    assert len(runs) == len(set(runs))
    # The variants serve the sweep alone: a run of theirs may stop once it cannot be the best.
    assert {(lr, v) for lr in swept for v in ("adam-sqrt", "adamw-tau")} <= sweep.sweep_only(config, 64)
    assert (0.02, "") not in sweep.sweep_only(config, 64)  # the constant rule's lr
    # Without a sweep, or with SGD, there is nothing to vary.
    assert sweep.variants(dataclasses.replace(config, rules=("adam-sqrt",)), 64) == {}
    sgd = _config(rules=("sqrt", "tuned"), optimizer=OptimizerConfig())
    assert sweep.variants(sgd, 64) == {}


def test_the_surge_rule_takes_b_noise_given_or_measured_at_the_reference_and_says_when_it_cannot():
    adamw = OptimizerConfig(family="adamw")
    rule = registry.get("surge")
    config = _config(rules=("tuned", "surge"), optimizer=adamw, noise_scale=64.0)
    # From B_noise/4 to the peak: η*(64)/η*(16) = 1/0.8.
    assert rule.group(config, 64, {}).runs == ((0.025, 0), (0.025, 1))
    assert rule.lr(config, 16, 64.0) == 0.02
    for bad, match in (({"noise_scale": None, "rules": ("surge", "constant")}, "surge rule needs B_noise"),
                       ({"optimizer": OptimizerConfig()}, "surge rule describes Adam")):
        with pytest.raises(UsageError, match=match):
            _config(**{"rules": ("tuned", "surge"), "optimizer": adamw, "noise_scale": 64.0, **bad})
    # Measured: B_simple along the best tuned runs at the reference batch (here tr Σ / |G|² = 20 / 2 = 10).
    config = _config(rules=("tuned", "surge"), optimizer=adamw, sweep_margin=1.0)
    reference = grid_group(config, 16, sweep.grid_runs(config, 16)).results()
    for run in reference:
        run.steps_to_target, run.noise_g2, run.noise_trace = 50, [2.0, 2.0], [10.0, 30.0]
    assert sweep.b_simple_at(config, 16, reference) == 10.0
    group = rule.group(config, 64, {16: reference})
    assert group.runs[0][0] == round_lr(0.02 * scaling.surge_lr_multiplier(16, 64, 10.0))
    # Not measurable (the reference's runs never arrived): the rule is skipped, and the warning says why.
    for run in reference:
        run.steps_to_target = None
    assert rule.group(config, 64, {16: reference}) is None
    batches = {16: sweep.view(config, 16, reference)}
    assert rule.report(config, batches, []) == {"surge": None}
    assert "surge rule did not run" in rule.warnings(config, batches)[0]


def test_the_reference_batch_a_rule_measures_at_is_trained_not_refused():
    # The newcomer's grid: AdamW, reference 32, batches 16,64,256; surge measures B_noise at 32.
    asked = dict(rules=("tuned", "sqrt", "adam-sqrt", "surge", "adamw-tau"), global_batch_sizes=(16, 64, 256),
                 reference_global_batch_size=32, optimizer=OptimizerConfig(family="adamw"))
    config = _config(**asked)
    assert config.global_batch_sizes == (16, 32, 64, 256) and config.reference_trained_for == ("surge",)
    # Kept through replace (the study anchors its rules' lr so), and out of the cached runs' fingerprint.
    anchored = dataclasses.replace(config, rules_lr=0.01)
    assert anchored.reference_trained_for == ("surge",) and anchored.global_batch_sizes == (16, 32, 64, 256)
    assert "reference_trained_for" not in config.settings("w")
    # With B_noise given, or the reference already in the grid, nothing is added.
    assert _config(**asked, noise_scale=64.0).global_batch_sizes == (16, 64, 256)
    assert _config(**{**asked, "global_batch_sizes": (16, 32, 64)}).reference_trained_for == ()


def test_the_registry_holds_every_rule_once_and_each_says_what_it_is():
    assert list(registry.known()) == ["constant", "linear", "sqrt", "adam-sqrt", "adamw-tau", "surge", "tuned",
                                    "adascale", "ramp", "schedule"]
    assert [rule.name for rule in registry.known().values() if rule.sweeps] == ["tuned"]
    assert {rule.name for rule in registry.known().values() if rule.shares_grid} == {"constant", "linear", "sqrt",
                                                                                   "tuned"}
    assert all(rule.summary for rule in registry.known().values())
    config = StudyConfig(target=Target(kind="loss", value=0.1), reference_global_batch_size=32, reference_lr=0.1,
                         optimizer=OptimizerConfig(family="adam"), rules=("constant", "linear", "sqrt", "adam-sqrt"))
    fixed = [registry.get(name).grid_lrs(config, 128) for name in ("constant", "linear", "sqrt")]
    assert fixed == [[0.1], [0.4], [0.2]]
    scaled = registry.get("adam-sqrt").optimizer(config, 128)
    assert scaled.betas == pytest.approx((0.6, 0.996)) and scaled.eps == pytest.approx(5e-9)
    with pytest.raises(UsageError, match="rules must be among"):
        StudyConfig(target=Target(kind="loss", value=0.1), rules=("cosine",))


class _NoTraining:
    name, overhead = "none", 1.0

    def train(self, *args, **kwargs):
        raise AssertionError("a cached group trained again")

    def seconds_per_step(self, *args):
        raise AssertionError("nothing to time")


@pytest.mark.timeout(120)
def test_the_spec_template_checks_and_studies_as_written(tmp_path, capsys):
    import json

    from ddplab.cli.main import main

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    template = os.path.join(root, "examples", "spec_template.py")
    assert main(["check", template, "--world-size", "2", "--batch-size", "8", "--steps", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "EQUIVALENT"
    assert main(["study", template, "--target-accuracy", "0.85", "--global-batch-sizes", "16,64", "--seeds", "1",
                 "--max-steps", "150", "--no-plots", "--json", "--out", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    # The template's AdamW is the study's optimizer, its lr the reference lr.
    assert report["optimizer"]["name"] == "AdamW" and report["reference"]["lr"] == 3e-3
    assert any(r["steps_to_target"] for r in report["runs"])


class Quartic(GridRule):
    """lr × k^(1/4), in the shared grid, saying what it is as the built-in rules do (its colour, its help clause, its
    sentence and its section of report.html)."""

    name = "quartic"
    summary = "lr × k^(1/4)"
    help = "quartic is lr × k^(1/4), a rule of this test alone"
    colour = "tab:pink"

    def factor(self, k: float) -> float:
        return k ** 0.25

    def text(self, values: dict) -> list[str]:
        return [f"quartic lr at global batch {b}: {self.lr_for(values, b):.4g}" for b in values["global_batch_sizes"]]

    def html(self, values: dict) -> str:
        return "<h2>The quartic rule</h2>"

    def lr_for(self, values: dict, global_batch: int) -> float:
        reference = values["reference"]
        return reference["lr"] * self.factor(global_batch / reference["global_batch_size"])


def test_a_rule_registered_in_one_file_is_said_by_the_command_line_the_report_and_the_figures(monkeypatch, tmp_path,
                                                                                                capsys):
    import json

    from ddplab.cli.main import main
    from ddplab.study.report import html

    monkeypatch.setitem(registry.known(), Quartic.name, Quartic())
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit):
        main(["study", "--help-all"])  # every flag with its whole help; -h is the short one
    assert "quartic is lr × k^(1/4), a rule of this test alone" in " ".join(capsys.readouterr().out.split())
    main(["study", "--workload", "regression", "--rules", "constant,quartic", "--global-batch-sizes", "16,64",
          "--seeds", "1", "--max-steps", "20", "--engine", "vmap", "--no-plots", "--out", str(tmp_path)])
    with open(tmp_path / "study.json") as fh:
        values = {**json.load(fh), "plots": []}
    assert f"quartic lr at global batch 64: {Quartic().lr_for(values, 64):.4g}" in capsys.readouterr().out
    assert "<h2>The quartic rule</h2>" in open(html.write_html(values, str(tmp_path / "report.html"))).read()
    assert report_figures.color(Quartic.name) == "tab:pink"
