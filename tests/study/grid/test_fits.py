"""A fit says what its data hold: a B_crit outside the measured batches is a bound, the batches a fit left out are
named, and a plan from such a study takes no critical batch from it (no torch)."""

import pytest

from ddplab.plan.from_study import StudyLr, plan_from_study
from ddplab.plan.planner import Target
from ddplab.study.grid.analysis import _fits


def _two_seeds(steps: dict[int, float]) -> dict[int, list[float]]:
    return {b: [s, s] for b, s in steps.items()}


@pytest.mark.parametrize("steps, bound, said", [
    # Nearly flat: S(16)/S(64) = 50/42.5 puts the bend at B_crit ≈ 4, below the smallest batch.
    ({16: 50.0, 32: 45.0, 64: 42.5}, {"below": 16}, "read it as B_crit < 16, not as a value; measure smaller"),
    # Nearly 1/B: S(16)/S(64) = 400/110 puts it near 460, above the largest.
    ({16: 400.0, 32: 205.0, 64: 110.0}, {"above": 64}, "read it as B_crit > 64, not as a value; measure larger"),
])
def test_a_b_crit_fitted_outside_the_measured_batches_is_a_bound(steps, bound, said):
    fits, warnings = _fits({"tuned": _two_seeds(steps)})
    assert fits["tuned"]["bound"] == bound
    assert any(said in w and w.startswith("rule tuned: B_crit is fitted at") for w in warnings), warnings


def test_a_fit_through_two_batches_says_nothing_tests_its_shape():
    fits, warnings = _fits({"tuned": _two_seeds({16: 500.0, 64: 200.0})})
    assert fits["tuned"]["b_crit"] == pytest.approx(64)
    assert "rule tuned: fitted on 2 global batches (16, 64): two points fix S_min and B_crit exactly" in \
        " ".join(warnings)


def test_inside_the_batches_b_crit_is_a_value_and_a_batch_the_fit_left_out_is_named():
    # S = 100 (1 + 64 / B) at 16, 32 and 64: B_crit 64 exactly; batch 8's median never reached.
    steps = _two_seeds({16: 500.0, 32: 300.0, 64: 200.0})
    steps[8] = [float("inf"), float("inf")]
    fits, warnings = _fits({"tuned": steps})
    assert fits["tuned"]["b_crit"] == pytest.approx(64) and "bound" not in fits["tuned"]
    assert "rule tuned: fitted on global batches 16, 32, 64 only: the median run did not reach the target at 8, " \
           "which the fit leaves out" in warnings


STUDY = {"workload": "w", "train_size": 100_000, "optimizer": {"family": "adamw", "name": "AdamW"},
         "reference": {"global_batch_size": 16, "lr": 0.003},
         "tuned_lr": [{"global_batch_size": 16, "lr": 0.004}, {"global_batch_size": 32, "lr": 0.004},
                      {"global_batch_size": 64, "lr": 0.008}]}


def test_an_lr_far_past_the_measured_batches_follows_the_named_rule_and_says_it_is_extrapolated():
    study = {**STUDY, "fit": {"tuned": {"b_crit": 40.0}}}
    near = StudyLr(study)(96)  # 1.5× past the largest: the end segment, log-log (slope 1 between 32 and 64)
    assert near.lr == pytest.approx(0.012) and "extrapolated from the end segment of the measured batches 16–64" \
        in near.reason
    far = StudyLr(study)(512)  # 8× past it: AdamW's square-root rule from the best lr at 64
    assert far.lr == pytest.approx(0.008 * 8 ** 0.5)
    assert "more than 2× outside the measured batches 16–64, the sqrt rule from the best lr 0.008 at global batch " \
           "64" in far.reason and "interpolation" not in far.reason
    inside = StudyLr(study)(48)
    assert "log-log interpolation between measured batches" in inside.reason


def test_a_plan_from_a_study_whose_b_crit_is_a_bound_plans_no_critical_batch():
    study = {**STUDY, "fit": {"tuned": {"b_crit": 6.18, "bound": {"below": 16}}}}
    plan = plan_from_study({}, Target(devices=4, per_device_batch_size=16), None, study)
    assert plan.steps_factor is None
    assert any("the study's B_crit lies below its measured batches (B_crit < 16): no critical batch is planned "
               "with" in w for w in plan.warnings), plan.warnings
    assert "B_crit < 16, below the measured batches" in plan.reasons["lr"]


def test_a_best_lr_that_ties_at_the_evaluation_interval_is_said_and_makes_no_peak():
    # One seed, evaluated every 5 steps: at batch 64 the lrs 0.004 and 0.008 both reach the target at step 30.
    from ddplab.study.config import OptimizerConfig, StudyConfig, Target
    from ddplab.study.grid.analysis import analyze
    from ddplab.study.runs import RunResult

    config = StudyConfig(target=Target(kind="loss", value=1.0), global_batch_sizes=(16, 32, 64), seeds=1,
                         rules=("tuned",), reference_global_batch_size=16, reference_lr=0.004, sweep_factor=2.0,
                         sweep_margin=1.0, eval_every=5, optimizer=OptimizerConfig(family="adamw"))
    from ddplab.study.rules import sweep

    steps = {(16, 0.002): 80, (16, 0.004): 60, (16, 0.008): 70,
             (32, 0.004): 45, (32, 0.008): 40, (32, 0.016): 55, (32, 0.002): 60,
             (64, 0.004): 30, (64, 0.008): 30, (64, 0.016): 45, (64, 0.002): 50}
    results = {}
    for b in config.global_batch_sizes:
        results[b] = [RunResult(global_batch_size=b, lr=lr, seed=seed, variant=variant,
                                steps_to_target=steps.get((b, lr), 100))
                      for lr, seed, variant in sweep.grid_runs(config, b)]
    found = analyze(config, results)
    tied = [w for w in found.warnings if "ties with" in w]
    assert len(tied) == 1 and tied[0].startswith("at global batch 64 the best tuned lr 0.004 ties with 0.008 (30 "
                                                 "median steps, read every 5 steps over 1 seed)"), found.warnings
    # The best lrs 0.004, 0.008, 0.004 look like a peak at 32; but at 64 0.008 does as well as 0.004: the data do
    # not separate a peak from a plateau.
    assert [p["lr"] for p in found.tuned_lr] == [0.004, 0.008, 0.004]
    assert found.lr_peak["global_batch_size"] is None
    untied = {**steps, (64, 0.008): 35}
    for b in config.global_batch_sizes:
        for run in results[b]:
            run.steps_to_target = untied.get((b, run.lr), 100)
    assert analyze(config, results).lr_peak["global_batch_size"] == 32
