"""Summed losses: a loss that reached backward summed over its samples is SUM_REDUCTION.

The loss functions are wrapped to tag the autograd node of a ``reduction='sum'`` or ``'none'``
result (the tensor itself is untouched); ``Tensor.backward`` checks the node it starts from.

Whatever follows the sum (``loss / accumulation_steps``, a scale, a sum of terms), the scale is
judged by its effect too: during the audited window a hook on the tagged node reads the gradient
that backward brings to each summed term, its *weight*. A mean over a micro-batch of n samples
weighs each term at most 1/n (1/(n·A) with A accumulated micro-batches, less still per token); a sum
weighs it 1, or 1/A once divided by the accumulation steps, so it grows with the per-device batch.
"""

from __future__ import annotations

import functools
import math

import torch

from ddplab.auditor import state, tensors
from ddplab.auditor.patches import Patches

LOSS_FUNCTIONS = ("l1_loss", "mse_loss", "cross_entropy", "nll_loss", "binary_cross_entropy",
                  "binary_cross_entropy_with_logits", "smooth_l1_loss", "huber_loss", "kl_div",
                  "poisson_nll_loss", "gaussian_nll_loss", "soft_margin_loss", "multilabel_soft_margin_loss",
                  "hinge_embedding_loss", "margin_ranking_loss", "cosine_embedding_loss", "multi_margin_loss",
                  "triplet_margin_loss", "ctc_loss")
TAG = "ddplab_reduction"
# A summed term that weighs at least this many times what a mean over its micro-batch gives it grows with the batch.
GROWTH = 2.0
# Weights kept per optimizer step (a program that never steps must not grow the list).
MAX_WEIGHTS = 64


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
        if audit.armed and audit.micro_batch is not None and audit.micro_batch >= 2:
            # A hook on the graph's node, not on the user's tensor; it returns None: the gradient is unchanged.
            out.grad_fn.register_prehook(functools.partial(_weighed, audit.micro_batch))


def _weighed(micro_batch: int, grad_outputs):
    _note_weight(micro_batch, grad_outputs)
    return None


@state.guarded("weighing a summed loss")
def _note_weight(audit, micro_batch: int, grad_outputs) -> None:
    grad = grad_outputs[0] if grad_outputs else None
    # A DTensor loss (loss parallelism) is left alone: reading it could run a collective.
    if isinstance(grad, torch.Tensor) and tensors.is_plain(grad) and grad.numel() and \
            len(audit.loss_weights) < MAX_WEIGHTS:
        # The mean over the terms: 'none' terms summed by hand or masked weigh what a sum over them gives each.
        audit.loss_weights.append((float(grad.detach().double().mean()), micro_batch))


def check_step(audit, samples: int) -> None:
    """At an audited optimizer step: a summed loss, however divided, whose terms' weights grow with the batch.

    ``samples`` is the number the step's training forwards took on this rank (all its micro-batches).
    """
    weights, audit.loss_weights = audit.loss_weights, []
    if "SUM_REDUCTION" in audit.findings:
        return
    for weight, micro_batch in weights:
        accumulation = max(1, round(samples / micro_batch))
        divisor = 1 / weight if weight > 0 else math.inf
        # Divided by nothing, or by exactly the accumulation steps: a sum; any other scale is no evidence.
        if weight * micro_batch >= GROWTH and any(math.isclose(divisor, d, rel_tol=1e-3) for d in {1, accumulation}):
            audit.add("SUM_REDUCTION", _grown_detail(micro_batch, accumulation, round(divisor)) + _factor_note(audit))
            return


def _grown_detail(micro_batch: int, accumulation: int, divisor: int) -> str:
    mean = micro_batch * accumulation
    if divisor == 1:
        return (f"a summed loss reached backward undivided: each of a micro-batch's {micro_batch} samples weighs 1 in "
                f"the gradient where a mean would weigh it 1/{mean}, so the loss grows with the per-device batch")
    return (f"a summed loss reached backward divided by {divisor}, the {accumulation} micro-batches accumulated per "
            f"optimizer step: each of a micro-batch's {micro_batch} samples weighs 1/{divisor} in the gradient where "
            f"a mean would weigh it 1/{mean}, so the loss still grows with the per-device batch (dividing by the "
            "accumulation steps does not make a sum a mean)")


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
        audit.add("SUM_REDUCTION",
                  "a loss computed with reduction='sum' reached backward as it is" + _factor_note(audit))
    else:
        audit.add("SUM_REDUCTION", "per-sample losses (reduction='none') were summed with .sum() and reached "
                                   "backward without division by a count" + _factor_note(audit))


def _factor_note(audit) -> str:
    """Under a device mesh, what W is: the data-parallel size, which FSDP2 divides the reduced gradient by."""
    if audit.mesh is None or audit.data_parallel_size is None:
        return ""
    size = audit.data_parallel_size
    world = f", not the world size {audit.world_size}" if size != audit.world_size else ""
    return (f"; FSDP2 ({audit.strategy}) averages the gradients over the data-parallel ranks, so W here is the "
            f"data-parallel size {size}{world}")
