"""The scorecard and the lr peak: exact numbers from hand-made runs (no training), then one small real study whose
JSON carries them and whose surge and adamw-tau runs trained with the lr, β₂ and weight decay their rules give."""

from __future__ import annotations

import json
import math

import pytest

from ddplab.plan import scaling
from ddplab.study import workloads
from ddplab.study.config import OptimizerConfig, StudyConfig, StudyOptions, Target
from ddplab.study.grid import analysis
from ddplab.study.grid.study import run_study
from ddplab.study.report.records import StudyReport
from ddplab.study.rules import registry, sweep
from ddplab.study.rules.base import round_lr
from ddplab.study.runs import RunResult, grid_group

ADAMW = OptimizerConfig(family="adamw", betas=(0.9, 0.99), weight_decay=0.1)

# Steps to the target of each seed of each tuned-sweep setting, (batch, lr, variant) -> seeds; None: never arrived.
# Every other sweep run takes 100 steps.
SWEEP = {(16, 0.02, ""): [100, 120],
         (32, 0.02, ""): [80, 90], (32, 0.04, ""): [60, 70],
         (32, 0.02, "adamw-tau"): [75, 85], (32, 0.04, "adamw-tau"): [50, 56],
         (64, 0.02, ""): [44, 48]}
# The rules' own runs, (rule, batch) -> seeds.
OWN = {("adamw-tau", 16): [120, 140], ("adamw-tau", 32): [30, 40], ("adamw-tau", 64): [None, None],
       ("surge", 16): [None, None], ("surge", 32): [None, None], ("surge", 64): [None, None]}


def _config() -> StudyConfig:
    # sweep_margin 1: the sweep spans the constant and linear rules' lrs, 0.02 to 0.02·k.
    return StudyConfig(target=Target(kind="loss", value=0.1), global_batch_sizes=(16, 32, 64), seeds=2,
                       rules=("constant", "adamw-tau", "surge", "tuned"), reference_global_batch_size=16,
                       reference_lr=0.02, optimizer=ADAMW, sweep_margin=1.0, noise_scale=16.0)


def _arrive(run: RunResult, steps: int | None) -> RunResult:
    run.steps_to_target = steps
    run.history = [[steps or 200, 1.0, 0.05 if steps else 0.5]]
    return run


def _hand_made(config: StudyConfig) -> dict[int, list[RunResult]]:
    """Every run the study would train, from the groups the grid and the rules make, with steps set by hand."""
    results: dict[int, list[RunResult]] = {}
    for b in config.global_batch_sizes:
        group = grid_group(config, b, sweep.grid_runs(config, b), sweep.variants(config, b))
        results[b] = [_arrive(run, SWEEP.get((b, run.lr, run.variant), [100, 100])[run.seed])
                      for run in group.results()]
    for b in config.global_batch_sizes:
        for rule in registry.of(config):
            group = rule.group(config, b, results)
            if group is not None:
                results[b] += [_arrive(run, OWN[(rule.name, b)][run.seed]) for run in group.results()]
    # B_simple along the best runs at the reference: tr Σ / |G|² = 20 / 2.
    for run in results[16]:
        run.noise_g2, run.noise_trace = [2.0, 2.0], [10.0, 30.0]
    return results


def test_the_scorecard_from_hand_made_runs():
    config = _config()
    found = analysis.analyze(config, _hand_made(config))
    # The best tuned settings: 0.02 at 16, 0.04 with adamw-tau's settings at 32 (median 53), 0.02 at 64 (46).
    assert [(p["global_batch_size"], p["lr"], p["variant"], p["median_steps"]) for p in found.tuned_lr] == \
        [(16, 0.02, "", 110), (32, 0.04, "adamw-tau", 53), (64, 0.02, "", 46)]
    assert found.tuned_lr[1]["optimizer"]["betas"] == [0.9, 0.99 ** 2]
    card = found.scorecard
    assert card["tuned"] == {"median_abs_log2_lr_gap": 0.0, "median_steps_ratio": 1.0,
                             "steps_ratio_seed_range": [50 / 53, 56 / 53], "batches": 3, "beats_tuned": []}
    # constant: lr 0.02 everywhere, one octave below the best at 32 only; steps 110/110, 85/53, 46/46.
    assert card["constant"]["median_abs_log2_lr_gap"] == 0.0
    assert card["constant"]["median_steps_ratio"] == 1.0
    assert card["constant"]["steps_ratio_seed_range"] == [44 / 46, 120 / 110]
    # adamw-tau: lr 0.02·√k; gaps 0, ½ and 1 octave; steps 130/110, 35/53 and never.
    tau = card["adamw-tau"]
    assert tau["median_abs_log2_lr_gap"] == pytest.approx(0.5, abs=1e-9)
    assert tau["median_steps_ratio"] == 130 / 110 and tau["steps_ratio_seed_range"] == [120 / 110, 140 / 110]
    # At 32 both its seeds (30, 40 steps) beat both of the best tuned setting's (50, 56): said, as a warning too.
    assert tau["beats_tuned"] == [{"global_batch_size": 32, "steps": [30.0, 40.0], "tuned_steps": [50.0, 56.0],
                                   "tuned_lr": 0.04, "tuned_variant": "adamw-tau", "lr": round_lr(0.02 * 2 ** 0.5)}]
    assert any("rule adamw-tau beat the best tuned setting at global batch 32" in w for w in found.warnings)
    # surge, B_noise 16 (given) = the reference: its lr falls as 0.8 at 64 (√(1/4), √4); it never arrived.
    surge = card["surge"]
    assert surge["median_steps_ratio"] is None
    assert surge["median_abs_log2_lr_gap"] == pytest.approx(abs(math.log2(0.016 / 0.02)))
    # The best lr is highest at 32, above both ends: a peak inside the range; B_simple at the reference 10.
    assert found.lr_peak == {"global_batch_size": 32, "b_simple": 10.0}
    results = _hand_made(config)
    report = StudyReport(workload="hand-made", config=config, train_size=1000, analysis=found, out="").to_json()
    # Every run counted once, the sweep's runs with another rule's settings included.
    assert report["trained_runs"] == sum(len(runs) for runs in results.values())
    assert report["scorecard"]["surge"]["median_steps_ratio"] is None
    assert report["scorecard"]["constant"]["median_steps_ratio"] == 1.0
    assert report["lr_peak"] == {"global_batch_size": 32, "b_simple": 10.0}
    assert report["surge"]["noise_scale"] == 16.0 and report["surge"]["source"] == "given"


def test_the_scorecard_is_shown_only_where_its_seed_ranges_tell_two_rules_apart(capsys):
    from ddplab.cli.render import console
    from ddplab.cli.study import _print_scorecard

    config = _config()
    found = analysis.analyze(config, _hand_made(config))
    # tuned's seeds span 50/53 to 56/53, wholly below adamw-tau's 120/110 to 140/110: the two are told apart.
    assert found.scorecard_note is None
    # The same runs made alike: every seed of every setting 100 steps but one seed a step off, so each rule's range
    # overlaps every other's, and one seed measures no range at all.
    alike = _hand_made(config)
    for runs in alike.values():
        for run in runs:
            _arrive(run, 100 + run.seed)
    overlapping = analysis.analyze(config, alike)
    assert overlapping.scorecard["constant"]["steps_ratio_seed_range"] == [100 / 100.5, 101 / 100.5]
    assert overlapping.scorecard_note.startswith("every rule's seed range of steps ÷ tuned overlaps every other's")
    assert analysis.scorecard_note(1, found.scorecard).startswith("one seed measures no spread")
    assert analysis.scorecard_note(2, {"tuned": {"steps_ratio_seed_range": None}}) is None
    # A rule whose seeds never arrived lies above every finite range.
    assert analysis.scorecard_note(2, {"tuned": {"steps_ratio_seed_range": [0.9, 1.1]},
                                       "surge": {"steps_ratio_seed_range": [math.inf, math.inf]}}) is None
    report = StudyReport(workload="hand-made", config=config, train_size=1000, analysis=overlapping, out="").to_json()
    assert report["scorecard_note"] == overlapping.scorecard_note
    # The CLI says why in one line instead of a table of numbers that differ by noise.
    _print_scorecard(console(), report)
    printed = " ".join(capsys.readouterr().out.split())
    assert "scorecard: not shown: every rule's seed range" in printed and "steps ÷ tuned ┃" not in printed


def test_an_lr_that_rises_to_the_largest_batch_has_no_peak_and_sgd_has_no_lr_peak():
    tuned = [{"global_batch_size": b, "lr": lr} for b, lr in ((16, 0.02), (32, 0.04), (64, 0.04))]
    config = _config()
    assert analysis.lr_peak(config, tuned, None) == {"global_batch_size": None, "b_simple": None}
    tuned[1]["lr"] = 0.08
    assert analysis.lr_peak(config, tuned, None)["global_batch_size"] == 32
    sgd = StudyConfig(target=Target(kind="loss", value=0.1), global_batch_sizes=(16, 32, 64))
    assert analysis.lr_peak(sgd, tuned, None) is None


@pytest.mark.timeout(240)
def test_a_small_real_study_reports_the_scorecard_and_trains_each_rule_with_its_settings(tmp_path):
    """Regression (dim 8, where B_simple = dim + 1), AdamW, batches 16 and 64, two seeds, vectorized."""
    workload = workloads.regression(dim=8, n_train=512, n_val=128)
    start = float(workload.val[1].pow(2).mean())
    config = StudyConfig(target=Target(kind="loss", value=start * 0.05), global_batch_sizes=(16, 64), seeds=2,
                         rules=("tuned", "adamw-tau", "surge"), reference_global_batch_size=16, reference_lr=0.02,
                         optimizer=ADAMW, max_steps=300, sweep_margin=2.0, dtype="float64")
    report = run_study(workload, config, StudyOptions(out=str(tmp_path), plots=False, engine="vmap"))
    values = json.loads((tmp_path / "study.json").read_text())
    assert values == json.loads(json.dumps(report.to_json()))
    assert set(values["scorecard"]) == {"tuned", "adamw-tau", "surge"}
    for scores in values["scorecard"].values():
        assert {"median_abs_log2_lr_gap", "median_steps_ratio"} <= set(scores)
    assert values["scorecard"]["tuned"]["median_steps_ratio"] == 1.0
    assert set(values["lr_peak"]) == {"global_batch_size", "b_simple"}
    # Two batches cannot hold a peak inside; B_simple at the reference is near dim + 1.
    assert values["lr_peak"]["global_batch_size"] is None
    noise = values["lr_peak"]["b_simple"]
    assert noise == pytest.approx(9, rel=0.5)
    # surge took that B_simple for B_noise; each of its runs trained at the lr the rule gives, with AdamW as given.
    assert values["surge"]["noise_scale"] == noise and values["surge"]["source"] == "b_simple_at_reference"
    runs = values["runs"]
    # The rules scale from the sweep's best lr at the reference batch 16.
    scale = values["reference"]["rules_lr"]["lr"]
    assert values["reference"]["rules_lr"]["source"] == "best_at_reference"
    assert scale == next(p["lr"] for p in values["tuned_lr"] if p["global_batch_size"] == 16)
    for b in (16, 64):
        surge = [r for r in runs if r["rule"] == "surge" and r["global_batch_size"] == b]
        assert len(surge) == 2 and {r["lr"] for r in surge} == \
            {round_lr(scale * scaling.surge_lr_multiplier(16, b, noise))}
        assert all(r["optimizer"] == {"betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1} for r in surge)
    # adamw-tau at 64 (k = 4): lr × 2, β₂⁴, ε/2, λ × 2.
    tau = [r for r in runs if r["rule"] == "adamw-tau" and r["global_batch_size"] == 64]
    assert len(tau) == 2 and all(r["lr"] == round_lr(scale * 2) for r in tau)
    for r in tau:
        assert r["optimizer"]["betas"] == [0.9, 0.99 ** 4] and r["optimizer"]["eps"] == 5e-9
        assert r["optimizer"]["weight_decay"] == pytest.approx(0.2)
    # The tuned sweep at 64 trained every lr with adamw-tau's settings too; at the reference there is nothing to vary.
    swept = [r for r in runs if r["rule"] == "tuned" and r["global_batch_size"] == 64]
    assert {r["variant"] for r in swept} == {"", "adamw-tau"}
    assert {r["lr"] for r in swept if r["variant"]} == {r["lr"] for r in swept if not r["variant"]}
    assert {r["variant"] for r in runs if r["rule"] == "tuned" and r["global_batch_size"] == 16} == {""}


def test_the_reference_batch_surge_measures_at_trains_though_the_grid_left_it_out(tmp_path):
    """surge without --noise-scale measures B_noise at the reference batch 16, which the grid (64 alone) lacks: the
    study trains 16 too, scales the rules from its tuned best, and says so in study.json's warnings."""
    workload = workloads.regression(dim=8, n_train=512, n_val=128)
    start = float(workload.val[1].pow(2).mean())
    config = StudyConfig(target=Target(kind="loss", value=start * 0.05), global_batch_sizes=(64,), seeds=2,
                         rules=("tuned", "surge"), reference_global_batch_size=16, reference_lr=0.02,
                         optimizer=ADAMW, max_steps=300, sweep_margin=2.0, dtype="float64")
    run_study(workload, config, StudyOptions(out=str(tmp_path), plots=False, engine="vmap"))
    values = json.loads((tmp_path / "study.json").read_text())
    assert values["global_batch_sizes"] == [16, 64] and values["reference"]["rules_lr"]["source"] == "best_at_reference"
    assert values["surge"]["source"] == "b_simple_at_reference" and values["surge"]["noise_scale"] > 0
    assert values["warnings"][0] == ("global batch 16, the reference, was not in --global-batch-sizes and was trained "
                                     "too: the surge rule needs it for B_noise, the B_simple along the best tuned "
                                     "runs (--noise-scale gives it instead)")


def test_an_adaptive_rule_is_scored_by_its_mean_lr_and_never_said_to_beat_the_sweep():
    """AdaScale's lr is the reference lr × its mean recorded gain; its steps may beat a fixed lr's, which is no
    sign that the sweep missed a fixed setting."""
    config = StudyConfig(target=Target(kind="loss", value=0.1), global_batch_sizes=(32, 64), seeds=2,
                         rules=("tuned", "adascale"), reference_global_batch_size=32, reference_lr=0.1,
                         sweep_margin=1.0)
    results: dict[int, list[RunResult]] = {}
    for b in config.global_batch_sizes:
        results[b] = [_arrive(run, 100) for run in grid_group(config, b, sweep.grid_runs(config, b)).results()]
        for run in registry.get("adascale").group(config, b, results).results():
            run.gains = [[5, 1.0, 1.0], [10, 1.0, 2.0]] if b == 32 else [[5, 1.5, 1.5], [10, 2.0, 3.5]]
            results[b].append(_arrive(run, 10 + run.seed))
    found = analysis.analyze(config, results)
    scores = found.scorecard["adascale"]
    # At 32 its mean gain is 1 (lr 0.1, the best); at 64 it is 1.75 against the best 0.1 (a tie goes to the lower).
    assert scores["median_abs_log2_lr_gap"] == pytest.approx(math.log2(1.75) / 2)
    assert scores["median_steps_ratio"] == pytest.approx(10.5 / 100)
    assert scores["beats_tuned"] == [] and not any("beat the best tuned" in w for w in found.warnings)
