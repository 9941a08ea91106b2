"""Every torch loss function's units: what its mean divides by is exactly its sum over its mean, by torch."""

import pytest
import torch
import torch.nn.functional as F

from ddplab.auditor import loss_functions

torch.manual_seed(0)
LOGITS, CLASSES = torch.randn(6, 5, 3), torch.randint(5, (6, 3))  # 6 sequences of 3 positions, 5 classes
CLASSES[0, 2] = CLASSES[3, 0] = -100
X, Y = torch.randn(4, 7), torch.randn(4, 7)
PROBS = torch.rand(4, 7)
SMOOTHED = torch.softmax(torch.randn(5, 6), -1)
SMOOTHED[3] = 0  # a padding row of a label-smoothed target distribution

# name → (args, kwargs): one call of each loss function, as real programs write them.
CALLS = {
    "cross_entropy": ((LOGITS, CLASSES), {}),
    "cross_entropy_weighted": ((LOGITS, CLASSES), {"weight": torch.tensor([1.0, 2.0, 0.5, 3.0, 1.5])}),
    "cross_entropy_smoothed": ((LOGITS, CLASSES), {"label_smoothing": 0.1, "weight": torch.rand(5) + 0.5}),
    "cross_entropy_probabilities": ((LOGITS, torch.softmax(torch.randn(6, 5, 3), 1)), {}),
    "nll_loss": ((F.log_softmax(LOGITS, 1), CLASSES, torch.rand(5) + 0.5), {}),  # weight given by position
    "mse_loss": ((X, Y), {}),
    "l1_loss": ((X, Y), {}),
    "smooth_l1_loss": ((X, Y), {"beta": 0.5}),
    "huber_loss": ((X, Y), {}),
    "binary_cross_entropy": ((PROBS, (Y > 0).float()), {"weight": torch.rand(4, 7)}),
    "binary_cross_entropy_with_logits": ((X, (Y > 0).float()), {"pos_weight": torch.rand(7)}),
    "soft_margin_loss": ((X, Y.sign()), {}),
    "hinge_embedding_loss": ((X, Y.sign()), {}),
    "poisson_nll_loss": ((X, PROBS), {}),
    "gaussian_nll_loss": ((X, Y, torch.rand(4, 1) + 0.1), {}),
    "margin_ranking_loss": ((X[:, 0], Y[:, 0], torch.ones(4)), {}),
    "cosine_embedding_loss": ((X, Y, torch.tensor([1, -1, 1, 1])), {}),
    "triplet_margin_loss": ((X, Y, PROBS), {}),
    "multi_margin_loss": ((X, torch.tensor([0, 3, 6, 2])), {}),
    "multilabel_margin_loss": ((X, torch.tensor([[0, 3, -1, 0, 0, 0, 0]] * 4)), {}),
    "multilabel_soft_margin_loss": ((X, (Y > 0).float()), {}),
    "kl_div_batchmean": ((F.log_softmax(torch.randn(5, 6), -1), SMOOTHED), {"reduction": "batchmean"}),
    "kl_div": ((F.log_softmax(torch.randn(5, 6), -1), SMOOTHED), {}),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_means_units_are_what_torch_divides_its_sum_by(call):
    name = call.split("_weighted")[0].split("_smoothed")[0].split("_probabilities")[0].split("_batchmean")[0]
    function = getattr(F, name)
    args, kwargs = CALLS[call]
    reduction = kwargs.pop("reduction", "mean")
    units = loss_functions.units(name, function, args, {**kwargs, "reduction": reduction})
    assert units is not None and units.mean
    summed = function(*args, **kwargs, reduction="sum")
    mean = function(*args, **kwargs, reduction=reduction)
    # The count is exact: torch's own mean is its own sum over it, to float32's rounding.
    assert float(summed) / float(units.count) == pytest.approx(float(mean), rel=1e-5)


def test_a_sums_units_are_the_terms_that_weigh_something():
    # A summed divergence counts the target's rows that are not all zero (the Annotated Transformer's padding).
    units = loss_functions.units("kl_div", F.kl_div, (F.log_softmax(torch.randn(5, 6), -1), SMOOTHED),
                                 {"reduction": "sum"})
    assert not units.mean and int(units.count) == 4
    units = loss_functions.units("cross_entropy", F.cross_entropy, (LOGITS, CLASSES), {"reduction": "sum"})
    assert int(units.count) == 18 - 2  # ignore_index's targets weigh nothing
    # CTC: one term per sequence (its own division by the target length is part of the loss).
    log_probs = torch.randn(12, 3, 5).log_softmax(2)
    ctc = loss_functions.units("ctc_loss", F.ctc_loss, (log_probs, torch.randint(1, 5, (3, 4)),
                                                        torch.full((3,), 12), torch.tensor([4, 2, 3])), {})
    assert ctc.mean and ctc.count == 3


def test_what_cannot_be_counted_is_left_alone():
    assert loss_functions.units("mse_loss", F.mse_loss, (X, Y), {"reduction": "none"}) is None
    # The legacy arguments mean what torch derives from them: not read.
    assert loss_functions.units("mse_loss", F.mse_loss, (X, Y), {"size_average": False}) is None
    assert loss_functions.reduction(F.mse_loss, (X, Y, None, None, "sum"), {}) == "sum"  # reduction by position
    assert loss_functions.reduction(F.mse_loss, (X, Y), {}) == "mean"


def test_class_targets_are_those_a_class_index_loss_keeps_whatever_its_weights():
    """What noise counts as a language model's tokens: the targets that are not ignore_index, class weights or not;
    nothing for class probabilities, 'none', the legacy arguments or another loss."""
    for name, kwargs in (("cross_entropy", {}), ("cross_entropy", {"weight": torch.rand(5), "reduction": "sum"}),
                         ("nll_loss", {"ignore_index": -100})):
        targets = loss_functions.class_targets(name, getattr(F, name), (LOGITS, CLASSES), kwargs)
        assert targets.shape == (6, 3) and int(targets.kept) == 16
    probabilities = torch.softmax(torch.randn(6, 5, 3), 1)
    assert loss_functions.class_targets("cross_entropy", F.cross_entropy, (LOGITS, probabilities), {}) is None
    assert loss_functions.class_targets("cross_entropy", F.cross_entropy, (LOGITS, CLASSES),
                                        {"reduction": "none"}) is None
    assert loss_functions.class_targets("cross_entropy", F.cross_entropy, (LOGITS, CLASSES),
                                        {"size_average": False}) is None
    assert loss_functions.class_targets("mse_loss", F.mse_loss, (X, Y), {}) is None
