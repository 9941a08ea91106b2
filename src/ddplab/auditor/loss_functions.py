"""What each torch loss function's reduction counts: the units its mean divides by, read from its own arguments.

torch states every loss's normalisation in its arguments, and the audit judges the loss a program really computes:

- ``cross_entropy`` and ``nll_loss`` over class indices: the targets that are not ``ignore_index``; with class
  weights (``weight=``) a mean divides by the targets' summed weights, so the unit is one unit of class weight
  (label smoothing keeps that divisor); over class probabilities, the samples;
- ``kl_div``: ``'batchmean'`` the batch, ``'mean'`` every element, ``'sum'`` the rows of the target that are not all
  zero (a label-smoothed distribution zeroes its padding rows, which then weigh nothing);
- the elementwise losses (``mse``, ``l1``, ``smooth_l1``, ``huber``, ``binary_cross_entropy(_with_logits)`` —
  whose ``weight=`` rescales elements but not the divisor —, ``poisson_nll``, ``gaussian_nll``, ``soft_margin``,
  ``hinge_embedding``, ``margin_ranking``): their elements;
- the losses with one term per sample (``cosine_embedding``, ``triplet_margin``, ``multi_margin``,
  ``multilabel_margin``, ``multilabel_soft_margin``, ``ctc``): the samples (CTC's own division of each sequence by
  its target length is part of the loss, not of the batch's normalisation).

Each loss function registers one counter with :func:`counts`; a mean's weight per unit is the output's gradient over
the count, a sum's is the gradient itself (:mod:`ddplab.auditor.weights`). :func:`class_targets` gives the
class-index targets a call keeps whatever its weights: the tokens ``ddplab noise`` counts for a language model.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

Counter = Callable[[dict[str, Any], str], "torch.Tensor | int | None"]
COUNTERS: dict[str, Counter] = {}
"""loss function name → its counter: (its bound arguments, its reduction) → the units its reduction counts."""


@dataclasses.dataclass(frozen=True)
class Units:
    """What one call of a loss function reduced."""

    count: torch.Tensor | int
    """The units: a 0-dim tensor (read after backward, never synchronised here) or a number."""
    mean: bool
    """Whether the reduction divided by them (a mean), or summed."""


def counts(*names: str):
    """Register a counter for the loss functions ``names``."""
    def register(counter: Counter) -> Counter:
        for name in names:
            COUNTERS[name] = counter
        return counter
    return register


def units(name: str, function: Callable, args: tuple, kwargs: dict) -> Units | None:
    """The units of one call of ``function`` (torch.nn.functional.``name``) whose reduction is 'mean' or 'sum' (or
    kl_div's 'batchmean'); None for 'none', the legacy size_average/reduce arguments, or what cannot be counted."""
    counter = COUNTERS.get(name)
    arguments = _bind(function, args, kwargs)
    if counter is None or arguments is None:
        return None
    reduction = _reduction(arguments)
    if reduction not in ("mean", "sum", "batchmean"):
        return None
    count = counter(arguments, reduction)
    return None if count is None else Units(count, reduction != "sum")


@dataclasses.dataclass(frozen=True)
class ClassTargets:
    """The class-index targets of one cross_entropy or nll_loss call."""

    shape: torch.Size
    """The targets' shape: (batch,) or (batch, positions), or flattened positions."""
    kept: torch.Tensor
    """How many are not ``ignore_index``: a 0-dim tensor on their device (never synchronised here)."""


def class_targets(name: str, function: Callable, args: tuple, kwargs: dict) -> ClassTargets | None:
    """The class-index targets of one cross_entropy or nll_loss call whose reduction is 'mean' or 'sum'; None for
    other losses, class probabilities, 'none' and the legacy size_average/reduce arguments."""
    arguments = _bind(function, args, kwargs) if name in ("cross_entropy", "nll_loss") else None
    if arguments is None or _reduction(arguments) not in ("mean", "sum"):
        return None
    target = _tensor(arguments.get("target"))
    if target is None or target.is_floating_point():
        return None
    return ClassTargets(target.shape, _kept(arguments, target).sum())


def reduction(function: Callable, args: tuple, kwargs: dict) -> str | None:
    """The reduction one call of a loss function asked for ('mean' by default); None with the legacy
    size_average/reduce arguments, whose meaning torch derives otherwise."""
    arguments = _bind(function, args, kwargs)
    if arguments is None:
        return kwargs.get("reduction")
    return _reduction(arguments)


def _reduction(arguments: dict[str, Any]) -> str | None:
    if arguments.get("size_average") is not None or arguments.get("reduce") is not None:
        return None
    return arguments.get("reduction", "mean")


@functools.cache
def _signature(function: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(function)
    except (TypeError, ValueError):
        return None


def _bind(function: Callable, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    signature = _signature(function)
    if signature is None:
        return None
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _tensor(value) -> torch.Tensor | None:
    return value if isinstance(value, torch.Tensor) else None


def _elements(*values) -> int | None:
    tensors = [t for t in map(_tensor, values) if t is not None]
    if not tensors:
        return None
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    return int(torch.Size(shape).numel())


def _samples(tensor, batched_dims: int = 2) -> int | None:
    tensor = _tensor(tensor)
    if tensor is None:
        return None
    return int(tensor.shape[0]) if tensor.dim() >= batched_dims else 1


@counts("cross_entropy", "nll_loss")
def _class_targets(a: dict[str, Any], reduction: str):
    logits, target, weight = _tensor(a.get("input")), _tensor(a.get("target")), _tensor(a.get("weight"))
    if logits is None or target is None:
        return None
    if target.is_floating_point():
        # Class probabilities: one term per position, summed over the class dimension (1, or 0 for one sample).
        return logits.numel() // logits.shape[1] if logits.dim() >= 2 else 1
    kept = _kept(a, target)
    if weight is None:
        return kept.sum()
    # A mean divides by the kept targets' summed class weights: the unit is one unit of class weight.
    return (weight.detach()[torch.where(kept, target, 0)] * kept).sum()


def _kept(a: dict[str, Any], target: torch.Tensor) -> torch.Tensor:
    """Which class-index targets a loss keeps: those that are not its ``ignore_index``."""
    return target.ne(a.get("ignore_index", -100))


@counts("l1_loss", "mse_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
        "binary_cross_entropy_with_logits", "soft_margin_loss", "hinge_embedding_loss", "poisson_nll_loss",
        "gaussian_nll_loss")
def _elementwise(a: dict[str, Any], reduction: str):
    return _elements(a.get("input"), a.get("target"))


@counts("margin_ranking_loss")
def _ranking(a: dict[str, Any], reduction: str):
    return _elements(a.get("input1"), a.get("input2"), a.get("target"))


@counts("kl_div")
def _kl_div(a: dict[str, Any], reduction: str):
    inputs, target = _tensor(a.get("input")), _tensor(a.get("target"))
    if inputs is None or target is None:
        return None
    if reduction == "batchmean":
        return _samples(inputs, 1)
    if reduction == "mean":
        return _elements(inputs, target)
    if target.dim() == 0 or a.get("log_target"):
        return _elements(inputs, target) // max(1, inputs.shape[-1] if inputs.dim() else 1)
    # A summed divergence: per row (a position's distribution); rows whose target is all zero add nothing.
    return target.ne(0).any(-1).sum()


@counts("cosine_embedding_loss")
def _pairs(a: dict[str, Any], reduction: str):
    target = _tensor(a.get("target"))
    return None if target is None else target.numel()


@counts("triplet_margin_loss")
def _triplets(a: dict[str, Any], reduction: str):
    return _samples(a.get("anchor"))


@counts("multi_margin_loss", "multilabel_margin_loss", "multilabel_soft_margin_loss")
def _per_sample(a: dict[str, Any], reduction: str):
    return _samples(a.get("input"))


@counts("ctc_loss")
def _sequences(a: dict[str, Any], reduction: str):
    log_probs = _tensor(a.get("log_probs"))
    if log_probs is None:
        return None
    return int(log_probs.shape[1]) if log_probs.dim() == 3 else 1
