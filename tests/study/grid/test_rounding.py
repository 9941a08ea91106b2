"""A fit that rests on a run at a stop rule's edge says so, with the fit that turning it over gives (no torch).

The case is the one two engines disagreed on: the default digits study with 2 seeds, where at global batch 8 one
engine's seed 0 stalled and the other's reached in about the steps of seed 1, and B_crit read 7.4 on one and 93 on
the other.
"""

import math

import pytest

from ddplab.study import fit
from ddplab.study.config import StudyConfig, Target
from ddplab.study.grid import rounding
from ddplab.study.grid.analysis import _fits, analyze
from ddplab.study.rules import sweep
from ddplab.study.runs import RunResult, longest_plateau

CONFIG = StudyConfig(target=Target(kind="loss", value=0.5), global_batch_sizes=(8, 32, 128), seeds=2,
                     rules=("constant",), reference_global_batch_size=8, reference_lr=0.1, eval_every=5,
                     patience=40, max_steps=3000)


def _history(steps: int, plateau_from: int | None = None) -> list:
    """Evaluations every 5 steps whose loss falls to the target at ``steps``, flat from ``plateau_from`` on."""
    rows, loss = [], 2.0
    for step in range(5, steps + 1, 5):
        if plateau_from is None or step < plateau_from:
            loss = 0.5 + 1.5 * (1 - step / steps) + 1e-6
        rows.append([step, loss, loss])
    return rows


def _results(steps: dict[tuple[int, int], int | None], stalled_at: int = 1020) -> dict[int, list[RunResult]]:
    out = {}
    for b in CONFIG.global_batch_sizes:
        out[b] = []
        for lr, seed, variant in sweep.grid_runs(CONFIG, b):
            reached = steps[(b, seed)]
            run = RunResult(global_batch_size=b, lr=lr, seed=seed, variant=variant, steps_to_target=reached)
            if reached is None:
                run.stalled, run.history = True, _history(stalled_at, plateau_from=stalled_at - 5 * 40)
            else:
                run.history = _history(reached)
            out[b].append(run)
    return out


# Batch 8: seed 0 stalled, seed 1 reached in 1,215 steps; 32 and 128 reached by both seeds.
STALLED_AT_8 = {(8, 0): None, (8, 1): 1215, (32, 0): 395, (32, 1): 405, (128, 0): 275, (128, 1): 285}


def test_a_fit_that_a_stalled_seed_decides_says_so_with_the_fit_it_gives_turned_over():
    found = analyze(CONFIG, _results(STALLED_AT_8))
    # The median at 8 is inf, so the fit takes 32 and 128 only, and its bend falls below them.
    assert found.fit["constant"]["bound"] == {"below": 32}
    # Turned over, seed 0 reaches at its sibling's 1,215 steps: the exact fit over all three batches.
    exact = fit.fit_seeds({8: [1215.0, 1215.0], 32: [395.0, 405.0], 128: [275.0, 285.0]})
    assert 32 < exact["b_crit"] < 128
    said = [w for w in found.warnings if "float32 rounding can turn over" in w]
    assert len(said) == 1, found.warnings
    assert said[0].startswith("rule constant: its fit rests on runs float32 rounding can turn over (global batch 8, "
                              "lr 0.1, seed 0 stalled while 1 of its 2 seeds reached)")
    low, high = exact["b_crit_ci95"]
    reading = f"B_crit {exact['b_crit']:.3g} [{low:.3g}, {high:.3g}]"
    assert f"with the runs that did not arrive reaching, {reading}, instead of B_crit < 32" in said[0]
    record = found.fit["constant"]["rounding"]
    assert record["turned"] == {"reaching": reading}
    assert record["edge_runs"] == [{"global_batch_size": 8, "lr": 0.1, "seed": 0,
                                    "why": "stalled while 1 of its 2 seeds reached", "flipped_steps": 1215.0}]


def test_a_stalled_seed_beside_a_late_sibling_is_said_although_turning_both_would_cancel():
    # As measured on digits: at batch 8 seed 0 stalled and seed 1 reached after 95 of the stall rule's 100
    # evaluations. Turned together the median stays unreached; turned alone, seed 0's reaching moves the fit.
    results = _results(STALLED_AT_8)
    config = StudyConfig(**{**CONFIG.__dict__, "patience": 100})
    late = results[8][1]
    late.history = _history(1215, plateau_from=1215 - 5 * 94)
    found = analyze(config, results)
    record = found.fit["constant"]["rounding"]
    assert [e["why"] for e in record["edge_runs"]] == [
        "stalled while 1 of its 2 seeds reached",
        "reached after 95 evaluations without improving (the stall rule stops at 100)"]
    assert list(record["turned"]) == ["reaching"]


def test_a_stalled_seed_whose_turn_moves_nothing_says_nothing():
    config = StudyConfig(**{**CONFIG.__dict__, "seeds": 3})
    steps = {(8, 0): 1220, (8, 1): 1215, (8, 2): None, (32, 0): 395, (32, 1): 405, (32, 2): 400,
             (128, 0): 275, (128, 1): 285, (128, 2): 280}
    results = {b: [r for r in runs] for b, runs in _results_for(config, steps).items()}
    found = analyze(config, results)
    assert not [w for w in found.warnings if "rounding" in w], found.warnings
    assert "rounding" not in found.fit["constant"]


def _results_for(config: StudyConfig, steps: dict) -> dict[int, list[RunResult]]:
    out = {}
    for b in config.global_batch_sizes:
        out[b] = [RunResult(global_batch_size=b, lr=lr, seed=seed, variant=variant, steps_to_target=steps[(b, seed)],
                            stalled=steps[(b, seed)] is None, history=_history(steps[(b, seed)] or 1000))
                  for lr, seed, variant in sweep.grid_runs(config, b)]
    return out


def test_a_late_arrival_after_a_plateau_near_the_patience_is_an_edge_run_turned_into_not_reaching():
    late = RunResult(global_batch_size=8, lr=0.1, seed=0, steps_to_target=1215,
                     history=_history(1215, plateau_from=1215 - 5 * 24) + [[1220, 0.4, 0.4]])
    assert longest_plateau(CONFIG, late.history) == 25
    (edge,) = rounding.edge_runs(CONFIG, [late])
    assert math.isinf(edge.flipped_steps) and edge.why.startswith("reached after 25 evaluations without improving")
    early = RunResult(global_batch_size=8, lr=0.1, seed=0, steps_to_target=600, history=_history(600))
    assert rounding.edge_runs(CONFIG, [early]) == []


def test_a_run_reached_in_the_last_tenth_of_its_budget_is_near_the_budget_edge_without_a_stall_rule():
    config = StudyConfig(**{**CONFIG.__dict__, "patience": 0})
    run = RunResult(global_batch_size=8, lr=0.1, seed=0, steps_to_target=2800, history=_history(2800))
    (edge,) = rounding.edge_runs(config, [run])
    assert edge.why == "reached at step 2800 of its 3000-step budget"


@pytest.mark.parametrize("first, second, moved", [
    ({"b_crit": 60.0, "b_crit_ci95": [40.0, 90.0]}, {"b_crit": 70.0, "b_crit_ci95": [50.0, 95.0]}, False),
    ({"b_crit": 60.0, "b_crit_ci95": [40.0, 90.0]}, {"b_crit": 120.0, "b_crit_ci95": [80.0, 160.0]}, True),
    ({"b_crit": 21.0, "b_crit_ci95": [21.0, 21.0], "bound": {"below": 32}}, None, True),
    ({"b_crit": 21.0, "b_crit_ci95": [21.0, 21.0], "bound": {"below": 32}},
     {"b_crit": 20.0, "b_crit_ci95": [19.0, 22.0], "bound": {"below": 32}}, False),
])
def test_a_turn_moves_the_fit_when_its_kind_or_its_value_past_the_interval_changes(first, second, moved):
    assert rounding.moved(first, second) is moved


def test_the_turned_fit_is_the_fit_of_the_turned_steps():
    results = _results(STALLED_AT_8)
    by_batch = {b: runs for b, runs in results.items()}
    edges = [e for runs in by_batch.values() for e in rounding.edge_runs(CONFIG, runs)]
    turned = rounding.flipped_steps(by_batch, edges)
    assert turned[8] == [1215.0, 1215.0] and turned[32] == [395.0, 405.0]
    assert _fits({"constant": turned})[0]["constant"]["b_crit"] == pytest.approx(
        fit.fit_seeds(turned)["b_crit"])
