"""The put-back slices' shares judged across ranks (pure): what each rank kept against what every rank's loss sent."""

import math

import pytest

from ddplab.auditor import slice_shares


def _entry(rank, samples, step=0, compensated=False, **extra):
    return {"step": step, "backward": 0, "shape": [4, 16], "ordinal": 0, "kept": rank, "size": len(samples),
            "samples": samples, "compensated": compensated, "site": "train.py:12", **extra}


def _records(*entries_by_rank):
    return [{"rank": rank, "gathered_slices": list(entries)} for rank, entries in enumerate(entries_by_rank)]


# What each rank's loss sent each of the 2 slices: the same loss on both ranks sends the same numbers.
SAME = [[1.0, -2.0, 0.5], [3.0, 0.25, -1.0]]


def test_the_same_loss_on_every_rank_keeps_one_share_per_slice_and_names_the_parameters():
    split = {"through": ["visual.0.weight", "text.0.weight"], "outside": ["logit_scale"]}
    code, detail, fix = slice_shares.judge(_records([_entry(0, SAME, **split)], [_entry(1, SAME, **split)]))
    assert code == "GATHERED_LOSS_WITHOUT_WORLD_SIZE"
    assert "every rank's slice kept exactly 1/2" in detail and "the loss at train.py:12" in detail
    assert "at 1/2: 2 parameter tensors (visual.0.weight, text.0.weight)" in detail
    assert "whole: 1 parameter tensor (logit_scale)" in detail
    assert "make those outside the gather (logit_scale) get 2 times their gradient" in fix


def test_without_parameters_outside_the_catalogue_fix_stands():
    assert slice_shares.judge(_records([_entry(0, SAME)], [_entry(1, SAME)]))[2] is None


@pytest.mark.parametrize("compensated", [True, None])
def test_a_loss_times_the_world_size_or_of_unknown_scale_is_not_judged(compensated):
    assert slice_shares.judge(_records([_entry(0, SAME, compensated=compensated)], [_entry(1, SAME)])) is None


def test_slices_the_other_ranks_send_nothing_lost_nothing():
    own = [[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]], [[0.0, 0.0, 0.0], [3.0, 0.25, -1.0]]
    assert slice_shares.judge(_records([_entry(0, own[0])], [_entry(1, own[1])])) is None


def test_losses_that_differ_between_ranks_lose_terms_measured_by_norm_and_cosine():
    rank0, rank1 = [[1.0, 0.0], [0.0, 1.0]], [[0.0, 1.0], [1.0, 1.0]]
    code, detail, _ = slice_shares.judge(_records([_entry(0, rank0)], [_entry(1, rank1)]))
    assert code == "GATHERED_TERMS_MISSING"
    # kept: slice 0 [1, 0] of full [1, 1], slice 1 [1, 1] of full [1, 2]
    kept, full = [1, 0, 1, 1], [1, 1, 1, 2]
    norm = math.sqrt(sum(v * v for v in kept)) / math.sqrt(sum(v * v for v in full))
    cosine = sum(a * b for a, b in zip(kept, full)) / math.sqrt(sum(v * v for v in kept) * sum(v * v for v in full))
    assert f"{norm:.3g} of the norm" in detail and f"at cosine {cosine:.3f}" in detail


def test_a_cat_seen_on_one_rank_only_or_under_a_larger_world_is_not_judged():
    assert slice_shares.judge(_records([_entry(0, SAME)], [])) is None
    assert slice_shares.judge(_records([_entry(0, SAME)], [_entry(1, SAME)], [])) is None  # 3 ranks, a group of 2
    other_step = _records([_entry(0, SAME)], [_entry(1, SAME, step=1)])
    assert slice_shares.judge(other_step) is None


def test_one_element_off_by_rounding_is_still_a_scale_judged_by_norm_and_cosine():
    # Slice 1's last element: a full gradient near 0, where the two ranks' float32 sums round apart (share 0.55).
    rank0 = [[1.0, -2.0, 0.5], [3.0, 0.25, 1e-3]]
    rank1 = [[1.0, -2.0, 0.5], [3.0, 0.25, 1.2e-3]]
    code, _, _ = slice_shares.judge(_records([_entry(0, rank0)], [_entry(1, rank1)]))
    assert code == "GATHERED_LOSS_WITHOUT_WORLD_SIZE"


def test_a_loss_scaled_by_a_python_float_or_summed_is_not_judged():
    from types import SimpleNamespace

    from ddplab.auditor import gathers, scales

    def term(scale=1.0, floats=False, multipliers=(), summed=False):
        return scales.Reached(SimpleNamespace(summed=summed), scale, floats, multipliers)

    assert gathers._compensated([term(0.5), term(0.5)], 2) is False  # ClipLoss: (CE + CE) / 2
    assert gathers._compensated([term(1.0, multipliers=(2,)), term(1.0, multipliers=(2,))], 2) is True  # × W
    assert gathers._compensated([term(1.0, floats=True)], 2) is None  # × float(W)
    assert gathers._compensated([term(0.125, summed=True)], 2) is None  # reduction='sum' / b
    assert gathers._compensated([term(None)], 2) is None  # ÷ a count tensor
    assert gathers._compensated([], 2) is None


def test_a_reduction_that_does_not_average_over_w_or_gradients_scaled_after_backward_are_not_judged():
    from ddplab.auditor import findings
    from ddplab.runtime.reduction import Reduction

    records = _records([_entry(0, SAME)], [_entry(1, SAME)])
    assert findings._averaged_as_is(records, Reduction("ddp", 2, 2.0, ""))
    assert not findings._averaged_as_is(records, Reduction("fsdp", 2, 1.0, "set_gradient_divide_factor(1)"))
    records[0]["windows"] = [{"grad_scale": 2.0}]
    assert not findings._averaged_as_is(records, None)
