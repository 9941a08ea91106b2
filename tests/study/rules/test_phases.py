"""The schedule's accounting, phase by phase, against a fixed run: exact numbers on curves with a known answer."""

import pytest

from ddplab.adapt import thresholds as th
from ddplab.study.rules import phases


def test_phases_switch_at_the_first_step_boundary_past_each_threshold():
    schedule = th.parse([{"samples_seen": 0, "global_batch_size": 10, "lr": 0.1},
                         {"samples_seen": 95, "global_batch_size": 20, "lr": 0.2},
                         {"samples_seen": 200, "global_batch_size": 40, "lr": 0.2}])
    found = phases.phases(schedule, 16)
    # 10 steps of 10 reach 100 ≥ 95; 5 steps of 20 reach 200; the last step's 40 each.
    assert [(p.global_batch_size, p.lr_factor, p.start_samples, p.steps) for p in found] == [
        (10, 1.0, 0, 10), (20, 2.0, 100, 5), (40, 2.0, 200, 1)]
    assert found[-1].end_samples == phases.samples_after(schedule, 16) == 240
    assert phases.phases(schedule, 0) == [] and phases.samples_after(schedule, 0) == 0


def test_a_curve_is_read_between_evaluations_and_by_its_best_so_far():
    curve = [(10, 5.0), (20, 3.0), (30, 4.0), (40, 2.0)]
    assert phases.metric_at(curve, 25) == pytest.approx(3.5)
    assert phases.metric_at(curve, 5) is None and phases.metric_at(curve, 45) is None
    # A lower metric is better: 3.5 is first reached between 10 and 20; 2.5 only after the bump, from the best (3.0).
    assert phases.samples_to(curve, 3.5, higher_is_better=False) == pytest.approx(17.5)
    assert phases.samples_to(curve, 2.5, higher_is_better=False) == pytest.approx(35.0)
    assert phases.samples_to(curve, 1.0, higher_is_better=False) is None
    accuracy = [(10, 0.2), (20, 0.6), (30, 0.8)]
    assert phases.samples_to(accuracy, 0.7, higher_is_better=True) == pytest.approx(25.0)
    assert phases.samples_to(accuracy, 0.1, higher_is_better=True) == 10.0


def test_a_schedule_half_as_efficient_after_its_switch_is_found_behind_by_the_exact_ratio():
    # The fixed run at batch 10: loss 10 - s/100. The schedule matches it to its switch at 100 samples, then falls
    # half as fast per sample: 9 - (s - 100)/200. At s the fixed run reached that loss at 100 + (s - 100)/2.
    schedule = th.parse("0:10 100:20")
    fixed = [(s, 10 - s / 100) for s in range(10, 1001, 10)]
    run = [(s, 10 - s / 100) for s in range(10, 101, 10)] + [(s, 9 - (s - 100) / 200) for s in range(120, 701, 20)]
    steps = 10 + 30  # to 700 samples
    rows = phases.account(schedule, 0.1, [(steps, run)], [fixed], higher_is_better=False, target=0.0)
    assert [(r["global_batch_size"], r["steps"], r["start_samples"], r["end_samples"], r["lr"]) for r in rows] == [
        (10, 10, 0, 100, 0.1), (20, 30, 100, 700, 0.1)]
    assert rows[0]["samples_ratio"] == pytest.approx(1.0) and rows[0]["metric"] == pytest.approx(9.0)
    assert rows[1]["metric"] == pytest.approx(6.0) and rows[1]["fixed_metric"] == pytest.approx(3.0)
    assert rows[1]["samples_ratio"] == pytest.approx(700 / 400)
    assert rows[1]["samples_ratio_range"] == [pytest.approx(700 / 400)] * 2 and rows[1]["seeds"] == 1


def test_past_the_target_both_runs_are_read_at_the_target_and_seeds_give_a_median_and_range():
    schedule = th.parse("0:10 100:20")
    fixed = [(s, 10 - s / 100) for s in range(10, 801, 10)]  # reaches the target 3.0 at 700 samples
    fast = [(s, 10 - s / 100) for s in range(10, 101, 10)] + [(s, 9 - (s - 100) / 50) for s in range(120, 501, 20)]
    slow = [(s, 10 - s / 100) for s in range(10, 101, 10)] + [(s, 9 - (s - 100) / 100) for s in range(120, 801, 20)]
    rows = phases.account(schedule, 0.1, [(10 + 20, fast), (10 + 35, slow)], [fixed, fixed],
                          higher_is_better=False, target=3.0)
    # The fast seed ends at 500 samples (loss 1.0, past the target): against the fixed run's 700 to the target.
    assert rows[-1]["samples_ratio_range"] == [pytest.approx(500 / 700), pytest.approx(800 / 700)]
    assert rows[-1]["samples_ratio"] == pytest.approx((500 / 700 + 800 / 700) / 2)
    # The phases are the median seed's (the lower of two): 20 steps at 20.
    assert rows[-1]["steps"] == 20 and rows[-1]["seeds"] == 2
