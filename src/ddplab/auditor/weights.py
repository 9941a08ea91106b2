"""What each element of a loss weighs in the gradient, per micro-batch: the evidence for how a loss is normalised.

A loss's *weight per element* is the gradient backward brings to each of its terms: 1/n for a mean over n tokens,
1 for a sum, W/N for a sum divided by the step's N tokens all-reduced over W data-parallel ranks. It is read where
the terms are summed, by a hook on that autograd node (the graph's, never the user's tensor; it returns None, so the
gradient is unchanged):

- a loss function's ``reduction='mean'``: the output's gradient divided by the units its mean divides by (the
  targets that are not ``ignore_index``, the summed class weights, the batch, the elements: as each torch loss
  function states it, :mod:`ddplab.auditor.loss_functions`);
- ``reduction='sum'``: the output's gradient, for each such unit;
- ``reduction='none'``: the gradient of every term, where the nonzero ones are equal (masked terms weigh 0);
- a sum written by hand (``Tensor.sum``, ``torch.sum``) over a tensor computed from the model's output: the sum's
  gradient, for each nonzero summed element (a masked or one-hot product is zero elsewhere);
- a mean over every element written by hand (``Tensor.mean``, ``torch.mean``) of such a tensor (TRL's mean over a
  masked selection of log-probs): the mean's gradient over the elements it divides by.

Each record holds (micro-step, weight, count) under the line of the user's program that computed it;
:mod:`ddplab.auditor.normalisation` compares them across micro-batches and ranks once every rank's are in.
Records are made only in the audited window, at most :data:`MAX_RECORDS` per optimizer step.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import sysconfig

import torch

from ddplab.auditor import loss_functions, scales, state
from ddplab.guest import patches, tensors

MAX_RECORDS = 64
# Weights that differ by less than this (relative) are one weight: float32 rounding of 1/n.
UNIFORM = 1e-5
# torch's frames are not the user's line (a loss function called through nn.CrossEntropyLoss).
_TORCH_ROOT = os.path.dirname(torch.__file__) + os.sep
_DDPLAB_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# A library's frames (Transformers' loss_utils.py, a model's modeling file) are named beside the user's line.
_LIBRARY_DIRS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep


@dataclasses.dataclass
class Record:
    """One loss's terms in one micro-batch: where it was computed, what each counted element weighs, how many."""

    site: str
    micro_step: int
    count: torch.Tensor | int | float | None = None
    weight: float | None = None
    divide_by_count: bool = False  # a mean: the output's gradient is shared by ``count`` elements
    summed: bool = False  # a sum over its elements: a loss function's reduction='sum', or a full sum by hand
    what: str = ""  # the loss function's name, or 'a sum written by hand'


def site() -> str:
    """The user's line that computed the loss: the first frame outside torch, ddplab, the auditor's patches, the
    standard library and installed libraries; with the library's own line beside it where the loss is a library's
    (``train.py:88 (through loss_utils.py:42)``)."""
    frame = sys._getframe(1)
    library = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename == patches.TRANSPARENT_FILENAME or filename.startswith((_DDPLAB_ROOT, _TORCH_ROOT)):
            pass
        elif _is_library(filename):
            library = library or f"{os.path.basename(filename)}:{frame.f_lineno}"
        else:
            line = f"{os.path.basename(filename)}:{frame.f_lineno}"
            return line if library is None else f"{line} (through {library})"
        frame = frame.f_back
    return library or "?"


def _is_library(filename: str) -> bool:
    # Frozen modules (runpy) are the interpreter's; code run from a string (python -c, exec) is the program's own.
    return any(part in filename for part in _LIBRARY_DIRS) or filename.startswith((_STDLIB, "<frozen"))


def watch_loss_function(audit, name: str, function, args, kwargs, out: torch.Tensor) -> None:
    """A loss function's output: record its units' weight (a mean or a sum over the units its reduction counts)."""
    units = loss_functions.units(name, function, args, kwargs)
    if units is None:
        return
    _watch(audit, out, Record(site(), _micro_step(audit), count=units.count, divide_by_count=units.mean,
                              summed=not units.mean, what=f"{name}(reduction='sum')"))


def watch_terms(audit, out: torch.Tensor) -> None:
    """A ``reduction='none'`` output: its nonzero terms' weights, read from their gradients."""
    _watch(audit, out, Record(site(), _micro_step(audit)))


def watch_sum(audit, summed: torch.Tensor, out: torch.Tensor) -> None:
    """A full sum written by hand over a tensor computed from the model's output."""
    count = summed.detach().count_nonzero()
    _watch(audit, out, Record(site(), _micro_step(audit), count=count, summed=True, what="a sum written by hand"))


def watch_mean(audit, meaned: torch.Tensor, out: torch.Tensor) -> None:
    """A full mean written by hand over a tensor computed from the model's output (a masked selection of log-probs):
    each element weighs the output's gradient over the elements it divides by."""
    _watch(audit, out, Record(site(), _micro_step(audit), count=meaned.numel(), divide_by_count=True,
                              what="a mean written by hand"))


def _micro_step(audit) -> int:
    info = audit.training_info
    return info.micro_steps if info is not None else 0


def _watch(audit, out: torch.Tensor, record: Record) -> None:
    if len(audit.weight_records) >= MAX_RECORDS or out.grad_fn is None:
        return
    audit.weight_records.append(record)
    # The record rides on the graph's node (where scales.reached finds it), never on the user's tensor.
    out.grad_fn.metadata[scales.RECORD] = record
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


def flush(audit, loss_scale: float = 1.0) -> dict[str, list[list[float]]]:
    """This step's records as ``{site: [[micro-step, weight per element, elements], ...]}``; cleared for the next.

    ``loss_scale``: what an engine multiplied the loss by before backward (fp16's dynamic loss scale), taken out."""
    records, audit.weight_records = audit.weight_records, []
    by_site: dict[str, list[list[float]]] = {}
    for record in records:
        if record.weight is None or record.count is None:
            continue  # no backward reached it (a loss computed for logging)
        count = float(record.count)
        if count <= 0 or record.weight == 0:
            continue
        # Whole counts stay whole (tokens, samples); summed class weights keep their fraction.
        count = int(count) if count.is_integer() else count
        weight = (record.weight / count if record.divide_by_count else record.weight) / loss_scale
        by_site.setdefault(record.site, []).append([record.micro_step, weight, count])
    return by_site
