"""The program's scaling of its gradients between backward and the step: one factor, or none, read from a few copies.

The corpus (tune_recipe.py, in test_corpus.py) runs it under the launchers; these check the reading itself."""

import torch

from ddplab.auditor import findings, grad_scaling, losses, normalisation


def _pairs(*tensors):
    params = [torch.nn.Parameter(torch.zeros(t.numel())) for t in tensors]
    return params, [(p, t.clone()) for p, t in zip(params, tensors)]


def test_every_element_times_one_number_is_that_number():
    params, before = _pairs(torch.tensor([1.0, -2.0, 0.0, 4.0]), torch.tensor([0.5, 3.0]))
    after = [(p, t * (2 / 263)) for p, t in before]
    assert abs(grad_scaling._factor(before, after) / (2 / 263) - 1) <= 1e-6


def test_gradients_summed_over_ranks_or_with_a_term_added_have_no_one_factor():
    params, before = _pairs(torch.tensor([1.0, -2.0, 4.0]))
    other_rank = torch.tensor([0.5, 1.0, -1.0])
    assert grad_scaling._factor(before, [(params[0], before[0][1] + other_rank)]) is None
    # A zero that became nonzero: something was added (weight decay by hand), not scaled.
    params, before = _pairs(torch.tensor([1.0, 0.0]))
    assert grad_scaling._factor(before, [(params[0], torch.tensor([0.5, 0.1]))]) is None


def test_unchanged_gradients_are_one_and_cleared_ones_none():
    params, before = _pairs(torch.tensor([1.0, -2.0]))
    assert grad_scaling._factor(before, [(params[0], before[0][1].clone())]) == 1.0
    assert grad_scaling._factor(before, [(params[0], torch.zeros(2))]) is None
    # A different parameter read than the one copied: nothing is compared.
    assert grad_scaling._factor(before, [(torch.nn.Parameter(torch.zeros(2)), before[0][1])]) is None


def test_bfloat16_rounding_of_a_product_is_still_one_factor():
    params, before = _pairs(torch.linspace(-3, 3, 64).to(torch.bfloat16))
    scaled = [(params[0], before[0][1] * torch.tensor(0.0123, dtype=torch.bfloat16))]
    assert abs(grad_scaling._factor(before, scaled) / 0.0123 - 1) < 0.02


def test_a_sum_found_at_backward_is_taken_back_only_for_a_count_of_the_programs():
    # 2 micro-batches of 4 samples: dividing the gradients by 2 (the accumulation steps) leaves a sum a sum.
    assert not losses._normalised_after_backward(1.0, samples=8, micro_batch=4)
    assert not losses._normalised_after_backward(0.5, samples=8, micro_batch=4)
    assert losses._normalised_after_backward(2 / 263, samples=8, micro_batch=4)


def test_the_weights_say_the_scaling_they_include():
    windows = {0: {"grad_scale": 0.25}, 1: {"grad_scale": 0.25}}
    assert normalisation._scaled(windows).endswith("after backward: ×0.25 on every rank)")
    assert normalisation._scaled({0: {}, 1: {}}) == ""
    assert "rank 0 ×0.125, rank 1 ×0.25" in normalisation._scaled({0: {"grad_scale": 0.125}, 1: {"grad_scale": 0.25}})


def test_gradients_scaled_differently_per_rank_are_no_missing_all_reduce():
    digest = [["w", "a", 1.0]]
    windows = {("ddp0", 0): {0: {"grads": digest, "params": digest, "grad_scale": 0.5},
                             1: {"grads": [["w", "b", 2.0]], "params": [["w", "c", 2.0]], "grad_scale": 0.25}}}
    assert findings._first_difference(windows, "grads", "NO_ALLREDUCE", "gradients at") is None
    diverged = findings._first_difference(windows, "params", "PARAMS_DIVERGED", "parameters after optimizer step")
    assert "by a different number on each rank (rank 0 ×0.5, rank 1 ×0.25)" in diverged.detail
    # Scaled alike: gradients that still differ were not reduced.
    windows[("ddp0", 0)][1]["grad_scale"] = 0.5
    assert findings._first_difference(windows, "grads", "NO_ALLREDUCE", "gradients at") is not None
