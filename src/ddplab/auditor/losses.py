"""Summed losses: a loss that reached backward summed over its samples is SUM_REDUCTION.

The loss functions are wrapped to tag the autograd node of a ``reduction='sum'`` or ``'none'``
result (the tensor itself is untouched); ``Tensor.backward`` checks the node it starts from.
"""

from __future__ import annotations

import functools

import torch

from ddplab.auditor import state
from ddplab.auditor.patches import Patches

LOSS_FUNCTIONS = ("l1_loss", "mse_loss", "cross_entropy", "nll_loss", "binary_cross_entropy",
                  "binary_cross_entropy_with_logits", "smooth_l1_loss", "huber_loss", "kl_div",
                  "poisson_nll_loss", "gaussian_nll_loss", "soft_margin_loss", "multilabel_soft_margin_loss",
                  "hinge_embedding_loss", "margin_ranking_loss", "cosine_embedding_loss", "multi_margin_loss",
                  "triplet_margin_loss", "ctc_loss")
TAG = "ddplab_reduction"


def install(patches: Patches) -> None:
    functional = torch.nn.functional
    for name in LOSS_FUNCTIONS:
        if hasattr(functional, name):
            patches.replace(functional, name, _tag_reduction)
    patches.replace(torch.Tensor, "backward", _checking_backward)


def _checking_backward(original_backward):
    @functools.wraps(original_backward)
    def backward(self, *args, **kwargs):
        audit = state.current()
        if audit is not None and audit.armed:
            _check_loss(self)
        return original_backward(self, *args, **kwargs)

    return backward


def _tag_reduction(loss_fn):
    @functools.wraps(loss_fn)
    def wrapper(*args, **kwargs):
        out = loss_fn(*args, **kwargs)
        _tag(out, kwargs.get("reduction"))
        return out

    return wrapper


@state.guarded("tagging a loss")
def _tag(audit, out, reduction) -> None:
    # Tagged on the autograd node, which lives and dies with this loss's graph; the tensor is untouched.
    if reduction in ("sum", "none") and isinstance(out, torch.Tensor) and out.grad_fn is not None:
        out.grad_fn.metadata[TAG] = reduction


def summed(loss) -> bool:
    """Whether a loss reached this point summed over its samples (reduction='sum', or 'none' then .sum())."""
    node = getattr(loss, "grad_fn", None)
    if node is None:
        return False
    if node.metadata.get(TAG) == "sum":
        return True
    if node.name() == "SumBackward0" and node.next_functions:
        child = node.next_functions[0][0]
        # Per-sample losses summed and never divided by a count: the same as reduction='sum'.
        return child is not None and child.metadata.get(TAG) == "none"
    return False


@state.guarded("inspecting a loss")
def _check_loss(audit, loss: torch.Tensor) -> None:
    node = loss.grad_fn
    if node is None or not summed(loss):
        return
    if node.metadata.get(TAG) == "sum":
        audit.add("SUM_REDUCTION", "a loss computed with reduction='sum' reached backward as it is")
    else:
        audit.add("SUM_REDUCTION", "per-sample losses (reduction='none') were summed with .sum() and reached "
                                   "backward without division by a count")
