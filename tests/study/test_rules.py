"""Study rules as values: a new rule is one class and one registration, and the grid, the engines, the cache and
the analysis take it without another change. The rule here is the next one the study gains (AdamW's weight decay
at a constant timescale, Wang & Aitchison 2024), written as a user of the registry would, in this file alone."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from ddplab.errors import UsageError
from ddplab.study import analysis, grid, optim, rules, workloads
from ddplab.study.config import OptimizerConfig, StudyConfig, Target, round_lr
from ddplab.study.engines import vmap
from ddplab.study.report import StudyReport
from ddplab.study.rules.base import OwnGroupRule


class AdamWTau(OwnGroupRule):
    """lr × √k, and AdamW's weight decay scaled to keep its timescale B/(η·λ·N) in epochs: λ' = λ·k·η/η' = λ√k."""

    name = "adamw-tau"
    summary = "lr × √k with weight decay λ√k (a constant AdamW timescale)"
    adam_only = True

    def check(self, config: StudyConfig) -> None:
        if config.optimizer.family != "adamw":
            raise UsageError("the adamw-tau rule scales AdamW's decoupled weight decay: it needs {optimizer.family} "
                             "adamw")

    def runs(self, config: StudyConfig, global_batch: int) -> list[tuple[float, int]]:
        k = global_batch / config.reference_global_batch_size
        return [(round_lr(config.reference_lr * math.sqrt(k)), seed) for seed in range(config.seeds)]

    def optimizer(self, config: StudyConfig, global_batch: int) -> OptimizerConfig:
        k = global_batch / config.reference_global_batch_size
        return dataclasses.replace(config.optimizer, weight_decay=config.optimizer.weight_decay * math.sqrt(k))


@pytest.fixture
def adamw_tau(monkeypatch):
    rule = AdamWTau()
    monkeypatch.setitem(rules.REGISTRY, rule.name, rule)
    return rule


def _config(**fields) -> StudyConfig:
    return StudyConfig(**{"target": Target(kind="loss", value=0.05), "global_batch_sizes": (16, 64),
                          "rules": ("tuned", "adamw-tau"), "reference_global_batch_size": 16, "reference_lr": 0.02,
                          "optimizer": OptimizerConfig(family="adamw", weight_decay=0.1), "seeds": 2,
                          "max_steps": 300, "dtype": "float64", "sweep_margin": 2.0, **fields})


def test_a_rule_registered_in_one_file_trains_caches_and_is_fitted(adamw_tau, tmp_path):
    workload = workloads.regression(dim=8, n_train=512, n_val=128)
    config = _config()
    cache = grid.Cache(str(tmp_path), config.fingerprint(workload.fingerprint), fresh=False)
    results = grid.run_grid(workload, config, cache, vmap.VmapEngine())
    for b in config.global_batch_sizes:
        own = [r for r in results[b] if r.rule == "adamw-tau"]
        assert [(r.lr, r.seed) for r in own] == adamw_tau.runs(config, b)
    # Its group's cache file is named for it; a second study reads it back and trains nothing.
    assert {"batch-16-adamw-tau.json", "batch-64-adamw-tau.json"} <= set(os.listdir(tmp_path / "runs"))
    again = grid.run_grid(workload, config, cache, _NoTraining())
    assert {b: [r.to_json() for r in rs] for b, rs in again.items()} == \
        {b: [r.to_json() for r in rs] for b, rs in results.items()}
    found = analysis.analyze(config, results)
    assert set(found.steps_by_rule) == {"tuned", "adamw-tau"}
    assert all(len(steps) == config.seeds for steps in found.steps_by_rule["adamw-tau"].values())
    assert {r["rule"] for r in found.runs} == {"tuned", "adamw-tau"}
    report = StudyReport(workload=workload.name, config=config, train_size=workload.train_size, analysis=found,
                         out=str(tmp_path)).to_json()
    # Every run counted once: the grid's (its sweep's extensions too), and each of the rule's own.
    assert report["trained_runs"] == sum(len(rs) for rs in results.values())
    assert sum(r.rule == "adamw-tau" for rs in results.values() for r in rs) == 2 * config.seeds
    # Its runs are drawn in every plot, in a colour of its own.
    from ddplab.study import plots

    assert plots.color("adamw-tau") not in {plots.color(name) for name in rules.REGISTRY if name != "adamw-tau"}
    assert all(os.path.getsize(path) for path in plots.plots(report, results, str(tmp_path)))
    with pytest.raises(UsageError, match="adamw-tau rule scales AdamW"):
        _config(optimizer=OptimizerConfig(family="adam"))


def test_the_vectorized_engine_applies_the_rules_weight_decay_as_torch_adamw(adamw_tau):
    workload = workloads.regression(dim=8, n_train=512, n_val=128)
    config, b, steps = _config(), 64, 12
    group = adamw_tau.group(config, b, [])
    assert group.optimizer.weight_decay == pytest.approx(0.2) and group.cache_key == "-adamw-tau"
    trained = vmap.Group(workload, config, group)
    for step in range(steps):
        trained.step(step, measure=False)
    lr, seed = group.runs[1]
    model = workload.model().to(torch.float64)
    model.load_state_dict(vmap.seeded_state(workload, seed, torch.float64)[0])
    optimizer = optim.torch_optimizer(group.optimizer, model.parameters(), lr)
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.param_groups[0]["weight_decay"] == 0.2
    order = vmap.Batches(workload.train_size, b, [seed])
    inputs, targets = workload.train
    for step in range(steps):
        index = order.indices(step)[0]
        optimizer.zero_grad()
        workload.loss(model(inputs[index].to(torch.float64)), targets[index].to(torch.float64)).backward()
        optimizer.step()
    for name, param in model.named_parameters():
        torch.testing.assert_close(trained.params[name][1], param.detach(), rtol=1e-10, atol=1e-12)


def test_the_registry_holds_every_rule_once_and_each_says_what_it_is():
    assert list(rules.REGISTRY) == ["constant", "linear", "sqrt", "adam-sqrt", "tuned", "adascale", "ramp"]
    assert [rule.name for rule in rules.REGISTRY.values() if rule.sweeps] == ["tuned"]
    assert {rule.name for rule in rules.REGISTRY.values() if rule.shares_grid} == {"constant", "linear", "sqrt",
                                                                                   "tuned"}
    assert all(rule.summary for rule in rules.REGISTRY.values())
    config = StudyConfig(target=Target(kind="loss", value=0.1), reference_global_batch_size=32, reference_lr=0.1,
                         optimizer=OptimizerConfig(family="adam"), rules=("constant", "linear", "sqrt", "adam-sqrt"))
    assert [rules.get(name).grid_lrs(config, 128) for name in ("constant", "linear", "sqrt")] == [[0.1], [0.4], [0.2]]
    scaled = rules.get("adam-sqrt").optimizer(config, 128)
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

    template = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            "examples", "spec_template.py")
    assert main(["check", template, "--world-size", "2", "--batch-size", "8", "--steps", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "EQUIVALENT"
    assert main(["study", template, "--target-accuracy", "0.85", "--global-batch-sizes", "16,64", "--seeds", "1",
                 "--max-steps", "150", "--no-plots", "--json", "--out", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    # The template's AdamW is the study's optimizer, its lr the reference lr.
    assert report["optimizer"]["name"] == "AdamW" and report["reference"]["lr"] == 3e-3
    assert any(r["steps_to_target"] for r in report["runs"])
