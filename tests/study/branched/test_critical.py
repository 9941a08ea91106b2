"""The critical batch from branches and the schedule it implies: the pure arithmetic, on hand-made numbers."""

from __future__ import annotations

import doctest
import math

import pytest

from ddplab.errors import UsageError
from ddplab.study.branched import config as branched_config
from ddplab.study.branched import judgement as branched_judgement
from ddplab.study.branched.config import BranchConfig
from ddplab.study.branched.judgement import judge
from ddplab.study.branched.schedule import megatron_schedule, schedule

INF, NAN = math.inf, math.nan


def test_the_modules_doctests_hold_their_hand_computed_values():
    from ddplab.study.branched import schedule as branched_schedule

    results = [doctest.testmod(module) for module in (branched_config, branched_judgement, branched_schedule)]
    assert sum(r.attempted for r in results) >= 8 and sum(r.failed for r in results) == 0


def test_each_batch_is_judged_by_its_best_lr_and_the_default_tolerance_is_half_the_reference_seeds_range():
    losses = {
        4: {0.05: [2.0, 2.2, 2.4], 0.1: [1.9, 2.0, 2.3], 0.2: [INF, INF, INF]},  # best: 0.1, median 2.0
        8: {0.1: [2.3, 2.1, 2.2], 0.2: [2.05, 2.1, NAN]},  # 0.2's diverged seed is its worst: median 2.1
        16: {0.2: [2.5, 2.6, 2.7], 0.4: [2.3, 2.35, 2.4]},  # median 2.35 > 2.0 + 0.2
        32: {0.4: [2.0, 2.0, 2.0]},  # matches again, after a miss: noise, not the critical batch
    }
    found = judge(losses, 4)
    assert found.tolerance == pytest.approx(0.2)  # (2.3 - 1.9) / 2
    assert found.reference_loss == 2.0
    assert [(r["global_batch_size"], r["lr"], r["median_loss"]) for r in found.rows] == [
        (4, 0.1, 2.0), (8, 0.2, 2.1), (16, 0.4, 2.35), (32, 0.4, 2.0)]
    assert [r["matches"] for r in found.rows] == [True, True, False, True]
    assert found.rows[1]["seed_losses"] == [2.05, 2.1, INF]
    assert found.critical_batch_size == 8
    # Worst seeds: 8's best worst-seed lr is 0.1 (2.3 > 2.2): no match. Best seeds: 16's 2.3 > 2.2 stops it.
    assert found.interval == (4, 8)
    assert not found.at_edge


def test_a_given_tolerance_replaces_the_seeds_and_the_interval_brackets_the_critical_batch():
    losses = {2: {0.1: [1.0, 1.0]}, 4: {0.1: [1.05, 1.3]}, 8: {0.2: [1.08, 1.5]}, 16: {0.3: [1.2, 1.4]}}
    assert judge(losses, 2).critical_batch_size == 2  # two equal seeds: tolerance 0, any loss above fails
    found = judge(losses, 2, tolerance=0.2)
    assert found.tolerance == 0.2
    assert found.critical_batch_size == 4  # medians 1.175, 1.29, 1.3 against 1.2
    assert found.interval == (2, 16)  # worst seeds 1.3 fail at 4; best seeds 1.05, 1.08, 1.2 all match
    low, high = found.interval
    assert low <= found.critical_batch_size <= high
    assert judge(losses, 2, tolerance=1.0).at_edge
    # An interval spanning every batch branched tells nothing: the schedule takes no step from it. One inside the
    # grid, or the grid's top alone (every seed of every batch matches: a bound), does.
    assert not found.resolved
    assert found.unresolved_note(416) == (
        "the branches cannot tell the critical batch at 416 samples: its seeds' interval [2, 16] spans every batch "
        "branched, so the schedule takes no step from it (more seeds, or longer branches, would tell)")
    assert judge(losses, 2).unresolved_note(416) is None
    assert judge(losses, 2).resolved and judge(losses, 2).interval == (2, 2)
    assert judge(losses, 2, tolerance=1.0).resolved and judge(losses, 2, tolerance=1.0).interval == (16, 16)


def test_diverged_batches_never_match_and_a_diverged_reference_has_no_critical_batch():
    found = judge({8: {0.1: [1.0, 1.2]}, 16: {0.2: [NAN, NAN], 0.1: [INF, 5.0]}, 32: {0.4: [1.0, 1.0]}}, 8)
    assert found.rows[1]["lr"] is None and found.rows[1]["median_loss"] == INF
    assert found.critical_batch_size == 8 and found.interval == (8, 8)
    nothing = judge({8: {0.1: [NAN, NAN]}, 16: {0.2: [1.0, 1.0]}}, 8)
    assert nothing.critical_batch_size is None and nothing.interval == (None, None)
    with pytest.raises(UsageError, match="reference global batch 8"):
        judge({16: {0.1: [1.0]}}, 8)


def test_stopping_the_doubling_once_the_judgement_is_settled_changes_nothing_it_reports():
    # Random branch losses, some diverged: judged on every batch, and on the batches up to the first at which
    # the ladder would stop, the critical batch, its interval, the tolerance and the judged rows agree.
    import random

    rng = random.Random(0)
    stopped_early = 0
    for _ in range(500):
        batches = [4 << i for i in range(rng.randint(1, 6))]
        losses = {b: {lr: [rng.choice([INF, 1.0 + rng.random() * (1 + i / 3)]) if rng.random() < 0.05 else
                           1.0 + rng.random() * (1 + i / 3) for _ in range(3)] for lr in (0.1, 0.2, 0.4)}
                  for i, b in enumerate(batches)}
        tolerance = rng.choice([None, 0.0, 0.3])
        full = judge(losses, 4, tolerance)
        for end in range(1, len(batches) + 1):
            partial = judge({b: losses[b] for b in batches[:end]}, 4, tolerance)
            if branched_judgement.settled(partial) or end == len(batches):
                break
        stopped_early += end < len(batches)
        assert (partial.critical_batch_size, partial.interval, partial.tolerance) == \
            (full.critical_batch_size, full.interval, full.tolerance)
        assert partial.rows == full.rows[:end]
        # Settled means the largest batch judged misses with its every seed, which an unsettled one never does.
        if end < len(batches) and partial.critical_batch_size is not None:
            assert not partial.rows[-1]["matches"] and partial.interval[1] < batches[end - 1]
    assert stopped_early > 50


def test_a_lag_tolerance_is_the_references_own_progress_over_the_budgets_last_fraction():
    # An exponential decay at rate r per sample: a batch whose rate is at least half the reference's is at most half
    # the budget behind, and matches under lag 0.5 whatever the budget.
    rate = {2: 0.10, 4: 0.09, 8: 0.075, 16: 0.06, 32: 0.045}
    for budget in (64, 256):
        losses = {b: {0.1: [math.exp(-r * budget)]} for b, r in rate.items()}
        tolerance = branched_judgement.lag_tolerance(math.exp(-0.10 * budget), math.exp(-0.10 * budget * 0.5))
        assert judge(losses, 2, tolerance).critical_batch_size == 16
    assert branched_judgement.lag_tolerance(1.0, 0.9) == 0.0


def test_the_schedule_doubles_when_the_critical_batch_reaches_twice_the_batch_and_never_shrinks():
    checkpoints = [(5000, 64, {16: 0.15, 32: 0.2, 64: 0.3}), (1000, 16, {16: 0.12}), (3000, 8, {}),
                   (8000, 40, {})]  # given out of order; 40 < 2 × 64 keeps 64
    steps = schedule(checkpoints, 8, 0.1)
    assert steps == [{"samples_seen": 0, "global_batch_size": 8, "lr": 0.1},
                     {"samples_seen": 1000, "global_batch_size": 16, "lr": 0.12},
                     {"samples_seen": 5000, "global_batch_size": 64, "lr": 0.3}]
    assert megatron_schedule(steps) == "0:8 1000:16 5000:64"
    # A checkpoint at 0 samples whose critical batch is already larger replaces the start: one threshold 0.
    early = schedule([(0, 32, {32: 0.4})], 8, 0.1)
    assert early == [{"samples_seen": 0, "global_batch_size": 32, "lr": 0.4}]
    assert megatron_schedule(early) == "0:32"
    assert schedule([(100, None, {})], 8, 0.1) == [{"samples_seen": 0, "global_batch_size": 8, "lr": 0.1}]


def test_the_branch_config_checks_its_fields_and_derives_the_grid_and_budget():
    config = BranchConfig(branch_at=(0.6, 0.1, 0.3, 0.1))
    assert config.branch_at == (0.1, 0.3, 0.6)
    assert config.global_batch_sizes(8) == (8, 16, 32, 64, 128, 256)
    assert config.samples(8) == 8 * 256
    assert config.lr_rule(adam=False) == "linear" and config.lr_rule(adam=True) == "sqrt"
    assert BranchConfig(branch_from=("a.pt",), branch_lr_rule="sqrt").lr_rule(adam=False) == "sqrt"
    assert branched_judgement.sweep(branched_config.scaled_lr(0.1, 32, 8, "sqrt"), 2.0) == (0.1, 0.2, 0.4)
    for bad, field in (({}, "branch_at"), ({"branch_at": (0.1,), "branch_from": ("a",)}, "branch_at"),
                       ({"branch_at": (1.0,)}, "branch_at"), ({"branch_at": (0.1,), "branch_doublings": 0},
                                                               "branch_doublings"),
                       ({"branch_at": (0.1,), "branch_lag": 1.0}, "branch_lag"),
                       ({"branch_at": (0.1,), "branch_lag": 0.5, "branch_tolerance": 0.1}, "branch_tolerance"),
                       ({"branch_at": (0.1,), "branch_samples": 0}, "branch_samples")):
        with pytest.raises(UsageError) as error:
            BranchConfig(**bad)
        assert field in error.value.fields
    with pytest.raises(UsageError, match="multiple of the largest branched global batch 64"):
        BranchConfig(branch_at=(0.1,), branch_samples=100, branch_doublings=3).samples(8)


def test_a_paired_judgement_reads_each_seeds_own_deficit_where_the_seeds_spread_hides_it():
    # Seed s of every batch trains on the same samples: the reference's seeds spread by 0.3, batch 8 trails its own
    # seed by 0.1 on every one, batch 16 by 0.02 to 0.05.
    losses = {4: {0.1: [2.0, 2.3, 2.6]}, 8: {0.2: [2.1, 2.4, 2.7]}, 16: {0.4: [2.02, 2.35, 2.64]}}
    unpaired = judge(losses, 4)
    assert unpaired.tolerance == pytest.approx(0.3) and [r["matches"] for r in unpaired.rows] == [True, True, True]
    paired = judge(losses, 4, tolerance=0.05, paired=True)
    assert [r["paired_deficits"] for r in paired.rows] == [[0.0, 0.0, 0.0], [0.1, 0.1, 0.1], [0.02, 0.05, 0.04]]
    assert [r["paired_deficit"] for r in paired.rows] == [0.0, 0.1, 0.04]
    # 8 misses on every seed, so 16 cannot count: it matches after a miss.
    assert [r["matches"] for r in paired.rows] == [True, False, True]
    assert paired.critical_batch_size == 4 and paired.interval == (4, 4)
    # With a tolerance of 0.1 the worst seeds of 8 match (0.1) and 16's worst (0.05) too: the interval's low end.
    wider = judge(losses, 4, tolerance=0.1, paired=True)
    assert wider.critical_batch_size == 16 and wider.interval == (16, 16)
    # A diverged seed is an infinite deficit: it counts at the interval's low end, not at its median.
    losses[16][0.4] = [2.02, INF, 2.64]
    assert judge(losses, 4, tolerance=0.1, paired=True).interval == (8, 16)


def test_how_often_a_batch_matches_by_noise_exact_with_two_seeds_and_growing_with_more():
    from ddplab.study.branched import chance

    # Two seeds, no deficit: 1/2 + atan(1/√2)/π exactly; the simulation agrees within its own error (3σ).
    assert chance.exact_two_seeds(0.0) == pytest.approx(0.5 + math.atan(1 / math.sqrt(2)) / math.pi, abs=1e-6)
    for d in (0.0, 1.0, 2.0):
        p = chance.exact_two_seeds(d)
        assert chance.simulated(d, 2) == pytest.approx(p, abs=3 * math.sqrt(p * (1 - p) / 20000))
    assert chance.exact_two_seeds(0.0) > chance.exact_two_seeds(1.0) > chance.exact_two_seeds(2.0)
    # Half the range widens with more seeds while the medians' noise shrinks: a batch one σ worse matches more often.
    by_seeds = [chance.simulated(1.0, n) for n in (2, 3, 6)]
    assert by_seeds == sorted(by_seeds) and by_seeds[-1] - by_seeds[0] > 0.2
    assert chance.simulated(1.0, 3) == chance.simulated(1.0, 3)  # the same figure every time
