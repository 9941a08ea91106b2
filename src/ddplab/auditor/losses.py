"""Summed losses: a loss that reached backward summed over its samples is SUM_REDUCTION.

The loss functions are wrapped to tag the autograd node of a ``reduction='sum'`` or ``'none'``
result (the tensor itself is untouched); ``Tensor.backward`` checks the node it starts from.
A sum written by hand (``Tensor.sum``, ``torch.sum``) is watched when what it sums was computed from
the model's output in this micro-batch (its graph reaches the output within a few nodes): a regulariser
over the parameters, or a statistic of the input, is no loss over samples.

Whatever follows the sum (``loss / accumulation_steps``, a scale, a sum of terms), the scale is
judged by its effect too: during the audited window a hook on the tagged node reads the gradient
that backward brings to each summed term, its *weight*. A mean over a micro-batch of n samples
weighs each term at most 1/n (1/(n·A) with A accumulated micro-batches, less still per token); a sum
weighs it 1, or 1/A once divided by the accumulation steps, so it grows with the per-device batch.

A sum scaled by a constant the program wrote (``0.1 * (-0.5 * kl.sum())``, a β-VAE's divergence beside a mean
reconstruction term) is a sum too: when the only numbers between the sum and backward are Python floats and
integers (:mod:`ddplab.auditor.scales`) and none of them is a count of the batch it sums, its terms weigh the same
whatever the per-device batch, and that term is SUM_REDUCTION. A count of the program's own (a tensor) on the way is
a normalisation, judged across ranks by :mod:`ddplab.auditor.normalisation`.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from ddplab.auditor import gathers, grad_scaling, loss_functions, scales, state, weights
from ddplab.guest import tensors
from ddplab.guest.patches import Patches

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
# Model outputs remembered per optimizer step, and autograd nodes searched from a sum back to one of them.
MAX_OUTPUTS = 64
SEARCH_NODES = 256
# Autograd nodes that normalise what flows through them: a sum over their results is no sum over samples (a product
# with a single number, such as terms times dp_size / count, normalises too).
NORMALISING_NODES = ("MeanBackward", "DivBackward")


# A normaliser this close (relatively) to a count of the batch it sums divides by that count.
COUNT_TOLERANCE = 0.1
_INSIDE_LOSS_FUNCTION = [0]  # loss functions being computed: their own sums (gaussian_nll's) are theirs, not a hand's
_INSIDE_ENGINE_BACKWARD = [0]  # an engine's backward: its own Tensor.backward starts from its division, not the loss


def install(patches: Patches) -> None:
    functional = torch.nn.functional
    for name in LOSS_FUNCTIONS:
        if hasattr(functional, name):
            patches.replace(functional, name, functools.partial(_tag_reduction, name))
    patches.replace(torch.Tensor, "backward", _checking_backward)
    patches.replace(torch.Tensor, "sum", _watched_sum)
    patches.replace(torch, "sum", _watched_sum)
    patches.replace(torch.Tensor, "mean", _watched_mean)
    patches.replace(torch, "mean", _watched_mean)


def note_outputs(audit, output) -> None:
    """A training forward's output: the nodes a loss over its samples starts from (kept until the step)."""
    for tensor in tensors.iter_tensors(output):
        if tensor.grad_fn is not None and len(audit.output_nodes) < MAX_OUTPUTS:
            audit.output_nodes.append(tensor.grad_fn)


def _checking_backward(original_backward):
    @functools.wraps(original_backward)
    def backward(self, *args, **kwargs):
        audit = state.current()
        watched = audit is not None and audit.armed and not _INSIDE_ENGINE_BACKWARD[0]
        if watched:
            _check_loss(self)
        out = original_backward(self, *args, **kwargs)
        if watched:
            grad_scaling.after_backward()
        return out

    return backward


@contextlib.contextmanager
def engine_backward(loss):
    """An engine's backward of the program's loss (DeepSpeed's ``engine.backward``): the loss is judged as the
    program wrote it; the engine's own ``Tensor.backward`` inside, which starts from its division by the accumulation
    steps and its loss scale, is not judged again (those numbers are the engine's, not constants of the program)."""
    audit = state.current()
    if audit is not None and audit.armed and isinstance(loss, torch.Tensor):
        _check_loss(loss)
    _INSIDE_ENGINE_BACKWARD[0] += 1
    try:
        yield
    finally:
        _INSIDE_ENGINE_BACKWARD[0] -= 1


def _tag_reduction(name, loss_fn):
    @functools.wraps(loss_fn)
    def wrapper(*args, **kwargs):
        _INSIDE_LOSS_FUNCTION[0] += 1
        try:
            out = loss_fn(*args, **kwargs)
        finally:
            _INSIDE_LOSS_FUNCTION[0] -= 1
        _tag(name, loss_fn, out, args, kwargs)
        return out

    return wrapper


@state.guarded("tagging a loss")
def _tag(audit, name: str, loss_fn, out, args, kwargs) -> None:
    if not (isinstance(out, torch.Tensor) and out.grad_fn is not None) or _compiling():
        return
    reduction = loss_functions.reduction(loss_fn, args, kwargs)
    # Tagged on the autograd node, which lives and dies with this loss's graph; the tensor is untouched.
    if reduction in ("sum", "none"):
        out.grad_fn.metadata[TAG] = reduction
        _weigh(audit, out)
    if audit.armed and audit.training_info is not None:
        if reduction == "none":
            weights.watch_terms(audit, out)
        else:
            weights.watch_loss_function(audit, name, loss_fn, args, kwargs, out)


def _weigh(audit, out: torch.Tensor) -> None:
    if audit.armed and audit.micro_batch is not None and audit.micro_batch >= 2:
        # A hook on the graph's node, not on the user's tensor; it returns None: the gradient is unchanged.
        out.grad_fn.register_prehook(functools.partial(_weighed, audit.micro_batch))


def _watched_sum(original_sum):
    @functools.wraps(original_sum)
    def watched_sum(input, *args, **kwargs):
        out = original_sum(input, *args, **kwargs)
        audit = state.current()
        if audit is not None and audit.armed and isinstance(out, torch.Tensor) and out.grad_fn is not None and \
                not _INSIDE_LOSS_FUNCTION[0]:
            _hand_written_sum(input, out, not args and "dim" not in kwargs)
        return out

    return watched_sum


def _watched_mean(original_mean):
    @functools.wraps(original_mean)
    def watched_mean(input, *args, **kwargs):
        out = original_mean(input, *args, **kwargs)
        # Only a mean over every element (a masked selection's .mean(), TRL's); one over a dim is a model's own.
        if not args and not kwargs and not _INSIDE_LOSS_FUNCTION[0] and isinstance(out, torch.Tensor) and \
                out.grad_fn is not None:
            audit = state.current()
            if audit is not None and audit.armed:
                _hand_written_mean(input, out)
        return out

    return watched_mean


@state.guarded("watching a mean")
def _hand_written_mean(audit, meaned, out: torch.Tensor) -> None:
    node = getattr(meaned, "grad_fn", None)
    if _compiling() or audit.training_info is None or node is None or not tensors.is_local(meaned) or \
            scales.RECORD in node.metadata or not _from_model_output(audit, meaned):
        return  # a loss function's terms ('none', then .mean()) are weighed where they are already
    weights.watch_mean(audit, meaned, out)


@state.guarded("watching a sum")
def _hand_written_sum(audit, summed, out: torch.Tensor, full: bool) -> None:
    if _compiling() or audit.training_info is None or not tensors.is_local(summed) or \
            not _from_model_output(audit, summed):
        return
    _weigh(audit, out)
    if full:
        weights.watch_sum(audit, summed, out)


def _from_model_output(audit, tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements are the model's outputs, per element, within a few nodes of this step's training
    forwards: a path through a mean or a division (a per-experiment mean, terms divided before they are summed)
    means the sum's gradient is no longer what each sample weighs, so it does not count."""
    outputs = {id(node) for node in audit.output_nodes}
    frontier, seen = [tensor.grad_fn], set()
    while frontier and len(seen) < SEARCH_NODES:
        node = frontier.pop()
        if node is None or id(node) in seen:
            continue
        if id(node) in outputs:
            return True
        seen.add(id(node))
        if not _normalises(node):
            frontier.extend(child for child, _ in node.next_functions)
    return False


def _normalises(node) -> bool:
    """A mean, a division, or a product with one number (terms scaled by 1/count, or by a constant)."""
    name = node.name()
    if name.startswith(NORMALISING_NODES) or name == "MulBackward1":
        return True
    if name != "MulBackward0":
        return False
    try:
        operands = (getattr(node, "_saved_self", None), getattr(node, "_saved_other", None))
    except RuntimeError:  # saved tensors already freed: nothing to read
        return False
    return any(isinstance(t, torch.Tensor) and t.numel() == 1 for t in operands)


def _compiling() -> bool:
    # Under torch.compile the guest stays out of the traced graph.
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling()) if callable(is_compiling) else False


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
        audit.loss_weights.append((float(grad.detach().double().abs().mean()), micro_batch))


def check_step(audit, samples: int, grad_scale: float | None = None) -> None:
    """At an audited optimizer step: a summed loss, however divided, whose terms' weights grow with the batch.

    ``samples`` is the number the step's training forwards took on this rank (all its micro-batches);
    ``grad_scale`` what the program multiplied the gradients by after backward (:mod:`.grad_scaling`; None: unseen).
    """
    summed, audit.loss_weights = audit.loss_weights, []
    audit.output_nodes.clear()
    audit.gathered, audit.gather_backwards, audit.gather_inputs = None, 0, []
    at_backward, audit.summed_at_backward = audit.summed_at_backward, False
    if at_backward and grad_scale is not None and _normalised_after_backward(grad_scale, samples, audit.micro_batch):
        # The sum reached backward, but the program divided its gradients by a count of its own before the step
        # (torchtune's dp / the step's tokens): what each element weighs is judged across ranks, not here.
        del audit.findings["SUM_REDUCTION"]
    if "SUM_REDUCTION" in audit.findings:
        return
    for weight, micro_batch in summed:
        weight *= 1.0 if grad_scale is None else abs(grad_scale)
        accumulation = max(1, round(samples / micro_batch))
        divisor = 1 / weight if weight > 0 else math.inf
        # Divided by nothing, or by exactly the accumulation steps: a sum; any other scale is no evidence.
        if weight * micro_batch >= GROWTH and any(math.isclose(divisor, d, rel_tol=1e-3) for d in {1, accumulation}):
            audit.add("SUM_REDUCTION", _grown_detail(micro_batch, accumulation, round(divisor)))
            return


def _normalised_after_backward(grad_scale: float, samples: int, micro_batch: int | None) -> bool:
    """Whether a factor on the gradients after backward divides by more than nothing or the accumulation steps."""
    accumulation = max(1, round(samples / micro_batch)) if micro_batch else 1
    return not any(math.isclose(abs(grad_scale), 1 / d, rel_tol=1e-3) for d in {1, accumulation})


def _grown_detail(micro_batch: int, accumulation: int, divisor: int) -> str:
    mean = micro_batch * accumulation
    if divisor == 1:
        return (f"a summed loss reached backward undivided: each of a micro-batch's {micro_batch} samples weighs 1 in "
                f"the gradient where a mean would weigh it 1/{mean}, so the loss grows with the per-device batch")
    return (f"a summed loss reached backward divided by K = {divisor}, the micro-batches accumulated per "
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
    if node is None:
        return
    terms = scales.reached(node, loss.dtype)
    gathers.before_backward(audit, node, terms)
    if not summed(loss):
        _constant_scaled_sums(audit, terms)
    elif node.metadata.get(TAG) == "sum":
        _summed_at_backward(audit, "a loss computed with reduction='sum' reached backward as it is")
    else:
        _summed_at_backward(audit, "per-sample losses (reduction='none') were summed with .sum() and reached "
                                   "backward without division by a count")


def _summed_at_backward(audit, detail: str) -> None:
    """SUM_REDUCTION, as backward starts: taken back at the step if the program's own scaling of the gradients
    between backward and the step divided the sum by something other than the accumulation steps (:func:`check_step`).
    """
    if "SUM_REDUCTION" not in audit.findings:
        audit.add("SUM_REDUCTION", detail)
        audit.summed_at_backward = True


def _constant_scaled_sums(audit, terms: list[scales.Reached]) -> None:
    """A sum whose only scale on the way to backward is a constant the program wrote: its terms' weight stays the
    same whatever the per-device batch, beside any mean term whose weight shrinks with it."""
    if "SUM_REDUCTION" in audit.findings:
        return
    for term in terms:
        record = term.record
        if not (record.summed and term.python_floats and term.scale) or \
                _divided_by_a_count(record, term.scale, audit.micro_batch):
            continue
        means = sorted({other.record.site for other in terms if other.record.divide_by_count})
        beside = f", beside the mean at {means[0]}, whose weight shrinks as the batch grows" if means else ""
        _summed_at_backward(
            audit, f"{record.what} at {record.site} reached backward scaled by the constant {term.scale:.4g} and "
                   f"divided by no count of its batch: each of its terms weighs {abs(term.scale):.4g} in the "
                   f"gradient whatever the per-device batch{beside}, so that term grows with the per-device batch")
        return


def _divided_by_a_count(record: weights.Record, scale: float, samples: int | None) -> bool:
    """Whether 1/|scale| is (near) a count of the batch the sum is over: its micro-batch's ``samples`` (or a
    multiple: samples × positions), or its summed elements."""
    normaliser = 1 / abs(scale)
    counts = [int(record.count)] if record.count is not None else []
    if samples:
        counts.append(samples)
        multiple = round(normaliser / samples)
        if multiple >= 1 and math.isclose(normaliser, multiple * samples, rel_tol=COUNT_TOLERANCE / 10):
            return True
    return any(count > 0 and abs(normaliser - count) <= COUNT_TOLERANCE * count for count in counts)
