"""The rules whose batch changes against the fixed-batch Pareto front: the judgement by hand, the fitted front's samples
exactly, and the lines the study prints from them."""

from __future__ import annotations

import doctest
import math

import pytest

from ddplab.study import fit
from ddplab.study.grid import analysis

INF = math.inf
# The digits study on docs/study/branched.md: the tuned runs' median steps at each global batch, and its fit.
FIXED = [(32, 135.0), (64, 95.0), (128, 85.0)]
TUNED_FIT = {"s_min": 66.46711889794581, "e_min": 2109.357264242306, "b_crit": 31.735349737078742}


def test_the_doctests_hold_their_hand_computed_values():
    for module in (analysis, fit):
        result = doctest.testmod(module)
        assert result.attempted >= 2 and result.failed == 0, module.__name__


def test_a_fixed_batch_dominates_only_with_strictly_fewer_steps_and_strictly_fewer_samples():
    # Batch 64: 95 steps, 6080 samples; batch 128: 85 steps, 10880 samples; batch 32: 135 steps, 4320 samples.
    assert analysis.dominated_by(105, 9200, FIXED) == [64]
    assert analysis.dominated_by(105, 11000, FIXED) == [64, 128]
    assert analysis.dominated_by(200, 5000, FIXED) == [32]
    assert analysis.dominated_by(80, 8160, FIXED) == []  # fewer steps than every fixed batch
    # Ties: the same steps, or the same samples, is no domination.
    assert analysis.dominated_by(95, 7000, FIXED) == []
    assert analysis.dominated_by(100, 6080, FIXED) == []
    assert analysis.dominated_by(95.5, 6080.5, FIXED) == [64]
    # A batch whose median run never reached the target beats nothing; a rule that never did is beaten by every
    # batch that did.
    assert analysis.dominated_by(105, 9200, [(16, INF), *FIXED, (256, INF)]) == [64]
    assert analysis.dominated_by(INF, INF, [(16, INF), *FIXED]) == [32, 64, 128]
    assert analysis.dominated_by(105, 9200, []) == []


def test_the_fitted_fronts_samples_satisfy_its_equation_and_are_none_where_it_reaches_no_such_steps():
    s_min, e_min = TUNED_FIT["s_min"], TUNED_FIT["e_min"]
    for steps in (66.5, 80.0, 105.0, 1e4):
        samples = fit.front_samples(steps, s_min, e_min)
        assert (steps / s_min - 1) * (samples / e_min - 1) == pytest.approx(1.0, rel=1e-12)
    # On the fitted curve S(B) = S_min(1 + B_crit/B), E = S·B lies on the front.
    b_crit = TUNED_FIT["b_crit"]
    for b in (16, 64, 512):
        steps = s_min * (1 + b_crit / b)
        assert fit.front_samples(steps, s_min, e_min) == pytest.approx(steps * b, rel=1e-12)
    assert fit.front_samples(s_min, s_min, e_min) is None and fit.front_samples(60.0, s_min, e_min) is None
    assert fit.front_samples(INF, s_min, e_min) is None
    # No front: a fit without a bend (S_min 0, E_min nan) or a flat one (E_min 0).
    assert fit.front_samples(80.0, 0.0, math.nan) is None and fit.front_samples(80.0, 50.0, 0.0) is None


def test_each_adaptive_entry_gains_its_dominators_and_the_fronts_samples_at_its_steps():
    tuned = [{"global_batch_size": b, "median_steps": s} for b, s in FIXED]
    adaptive = {"ramp": {"median_steps": 105.0, "median_samples": 9200.0, "start_global_batch_size": 32},
                "schedule": {"median_steps": 80.0, "median_samples": 8160.0, "start_global_batch_size": 32},
                "late": {"median_steps": INF, "median_samples": INF, "start_global_batch_size": 32}}
    judged = analysis.against_the_front(adaptive, tuned, TUNED_FIT)
    s_min, e_min = TUNED_FIT["s_min"], TUNED_FIT["e_min"]
    assert judged["ramp"] == {**adaptive["ramp"], "dominated_by": [64],
                              "front_samples_at_steps": pytest.approx(e_min * 105 / (105 - s_min), rel=1e-12)}
    assert judged["schedule"]["dominated_by"] == []
    assert judged["schedule"]["front_samples_at_steps"] == pytest.approx(e_min * 80 / (80 - s_min), rel=1e-12)
    assert judged["late"]["dominated_by"] == [32, 64, 128] and judged["late"]["front_samples_at_steps"] is None
    # Without a tuned fit, or with an undefined (flat) one, there is no front to give samples from.
    assert analysis.against_the_front(adaptive, tuned, None)["ramp"]["front_samples_at_steps"] is None
    flat = {**TUNED_FIT, "undefined": "steps do not fall as the batch grows"}
    assert analysis.against_the_front(adaptive, tuned, flat)["ramp"]["front_samples_at_steps"] is None
    assert analysis.against_the_front(adaptive, [], None)["ramp"]["dominated_by"] == []


def test_the_printed_lines_say_each_rules_dominators_and_its_side_of_the_fitted_front(capsys, monkeypatch):
    from ddplab.cli.render import console
    from ddplab.study.report.text import front_lines

    def _print_front(out, values):
        # The library says it; the command line prints each sentence as a line.
        for line in front_lines(values):
            out.print(line)

    monkeypatch.setenv("COLUMNS", "400")
    tuned = [{"global_batch_size": b, "median_steps": s} for b, s in FIXED]
    s_min, e_min = TUNED_FIT["s_min"], TUNED_FIT["e_min"]
    values = {"tuned_lr": tuned, "adaptive": {
        "ramp": {"median_steps": 105.0, "median_samples": 11000.0, "dominated_by": [64, 128],
                 "front_samples_at_steps": e_min * 105 / (105 - s_min)},
        "schedule": {"median_steps": 80.0, "median_samples": 8160.0, "dominated_by": [],
                     "front_samples_at_steps": e_min * 80 / (80 - s_min)},
        "late": {"median_steps": None, "median_samples": None, "dominated_by": [32, 64, 128],
                 "front_samples_at_steps": None}}}
    _print_front(console(), values)
    assert capsys.readouterr().out.splitlines() == [
        "ramp (105 steps, 11000 samples): above the fixed-batch front: dominated by global batches 64 (95 steps, 6080 "
        "samples), 128 (85 steps, 10880 samples); above the tuned fit's front, which needs 5747.8835 samples at 105 "
        "steps",
        "schedule (80 steps, 8160 samples): on or below the fixed-batch front (no fixed batch reaches the target in "
        "both fewer steps and fewer samples); below the tuned fit's front, which needs 12469.5237 samples at 80 steps",
        "late: its median run did not reach the target: dominated by every fixed batch that did (32, 64, 128)"]
    # The numbers above, exactly: E_min·S/(S − S_min), to four decimals.
    assert f"{e_min * 105 / (105 - s_min):.4f}" == "5747.8835" and f"{e_min * 80 / (80 - s_min):.4f}" == "12469.5237"
    # No front: no tuned batch at all, or none whose median run arrived.
    for fixed in ([], [{"global_batch_size": 32, "median_steps": None}]):
        _print_front(console(), {"tuned_lr": fixed,
                                 "adaptive": {"ramp": {**values["adaptive"]["ramp"], "dominated_by": []}}})
        assert capsys.readouterr().out.strip() == ("ramp: no fixed batch of the tuned sweep reached the target: no "
                                                   "front to judge it against")
