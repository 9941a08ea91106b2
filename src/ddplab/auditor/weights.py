"""What each element of a loss weighs in the gradient, per micro-batch: the evidence for how a loss is normalised.

A loss's *weight per element* is the gradient backward brings to each of its terms: 1/n for a mean over n tokens,
1 for a sum, W/N for a sum divided by the step's N tokens all-reduced over W data-parallel ranks. It is read where
the terms are summed, by a hook on that autograd node (the graph's, never the user's tensor; it returns None, so the
gradient is unchanged):

- a loss function's ``reduction='mean'`` over class indices (``cross_entropy``, ``nll_loss``): the output's gradient
  divided by the targets that are not ``ignore_index``;
- ``reduction='sum'`` over class indices: the output's gradient, for each such target;
- ``reduction='none'``: the gradient of every term, where the nonzero ones are equal (masked terms weigh 0);
- a sum written by hand (``Tensor.sum``, ``torch.sum``) over a tensor computed from the model's output: the sum's
  gradient, for each nonzero summed element (a masked or one-hot product is zero elsewhere).

Each record holds (micro-step, weight, count) under the line of the user's program that computed it;
:mod:`ddplab.auditor.normalisation` compares them across micro-batches and ranks once every rank's are in.
Records are made only in the audited window, at most :data:`MAX_RECORDS` per optimizer step.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

import torch

from ddplab.auditor import patches, state, tensors

MAX_RECORDS = 64
# Loss functions whose targets are class indices that ``ignore_index`` can mask: token-level losses.
CLASS_INDEX_LOSSES = ("cross_entropy", "nll_loss")
# Weights that differ by less than this (relative) are one weight: float32 rounding of 1/n.
UNIFORM = 1e-5
# torch's frames are not the user's line (a loss function called through nn.CrossEntropyLoss).
_TORCH_ROOT = os.path.dirname(torch.__file__) + os.sep
_DDPLAB_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@dataclasses.dataclass
class Record:
    """One loss's terms in one micro-batch: where it was computed, what each counted element weighs, how many."""

    site: str
    micro_step: int
    count: torch.Tensor | int | None = None
    weight: float | None = None
    divide_by_count: bool = False  # a mean: the output's gradient is shared by ``count`` elements


def site() -> str:
    """The user's line that computed the loss: the first frame outside torch, ddplab and the auditor's patches."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (filename == patches.TRANSPARENT_FILENAME or filename.startswith((_DDPLAB_ROOT, _TORCH_ROOT))):
            return f"{os.path.basename(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def watch_loss_function(audit, name: str, args, kwargs, out: torch.Tensor) -> None:
    """A loss function's output: record its class-index terms' weight (mean or sum over the targets kept)."""
    reduction = kwargs.get("reduction", "mean")
    if name not in CLASS_INDEX_LOSSES or reduction not in ("mean", "sum") or kwargs.get("weight") is not None:
        return  # class weights make the mean a weighted one: not a count this can read
    target = args[1] if len(args) > 1 else kwargs.get("target")
    if not (isinstance(target, torch.Tensor) and tensors.is_plain(target)) or target.is_floating_point():
        return
    count = target.ne(kwargs.get("ignore_index", -100)).sum()
    _watch(audit, out, Record(site(), _micro_step(audit), count=count, divide_by_count=reduction == "mean"))


def watch_terms(audit, out: torch.Tensor) -> None:
    """A ``reduction='none'`` output: its nonzero terms' weights, read from their gradients."""
    _watch(audit, out, Record(site(), _micro_step(audit)))


def watch_sum(audit, summed: torch.Tensor, out: torch.Tensor) -> None:
    """A full sum written by hand over a tensor computed from the model's output."""
    count = summed.detach().count_nonzero()
    _watch(audit, out, Record(site(), _micro_step(audit), count=count))


def _micro_step(audit) -> int:
    info = audit.training_info
    return info.micro_steps if info is not None else 0


def _watch(audit, out: torch.Tensor, record: Record) -> None:
    if len(audit.weight_records) >= MAX_RECORDS or out.grad_fn is None:
        return
    audit.weight_records.append(record)
    out.grad_fn.register_prehook(functools.partial(_weighed, record))


def _weighed(record: Record, grad_outputs):
    _read_weight(record, grad_outputs)
    return None


@state.guarded("weighing a loss's terms")
def _read_weight(audit, record: Record, grad_outputs) -> None:
    grad = grad_outputs[0] if grad_outputs else None
    # A DTensor gradient (loss parallelism) is left alone: reading it could run a collective.
    if not (isinstance(grad, torch.Tensor) and tensors.is_plain(grad) and grad.numel()):
        return
    grad = grad.detach().double().abs()
    if record.count is None:
        kept = grad[grad != 0]
        if kept.numel() == 0 or float(kept.max() - kept.min()) > UNIFORM * float(kept.max()):
            return  # terms weighted unequally (per-sample weights): not a normalisation by a count
        record.count, record.weight = kept.numel(), float(kept[0])
    else:
        record.weight = float(grad.mean())


def flush(audit) -> dict[str, list[list[float]]]:
    """This step's records as ``{site: [[micro-step, weight per element, elements], ...]}``; cleared for the next."""
    records, audit.weight_records = audit.weight_records, []
    by_site: dict[str, list[list[float]]] = {}
    for record in records:
        if record.weight is None or record.count is None:
            continue  # no backward reached it (a loss computed for logging)
        count = int(record.count)
        if count <= 0 or record.weight == 0:
            continue
        weight = record.weight / count if record.divide_by_count else record.weight
        by_site.setdefault(record.site, []).append([record.micro_step, weight, count])
    return by_site
