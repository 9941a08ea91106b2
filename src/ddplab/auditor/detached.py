"""Products of this rank's features with gathered copies that carry no gradient: GATHERED_TERMS_MISSING.

open_clip's ``--local-loss`` without ``--gather-with-grad``: each rank multiplies its own features (with their graph)
by every rank's features all-gathered without autograd, its own copy among them detached too. The loss sends those
copies a gradient that goes nowhere, on every rank: the terms the columns owe the features that made them are
missing (one process, gathering nothing, has them).

Found by evidence only: in a step that gathered features requiring grad, a matrix product near the loss whose one
operand has no gradient, and that operand split into one slice per rank holds, at this rank's place, exactly the
features the step gathered. A hook before the product's backward reads what it received and computes, read-only,
the gradient the detached operand would have got; a nonzero one is the finding.
"""

from __future__ import annotations

import functools

import torch

from ddplab.auditor import state
from ddplab.auditor.catalogue import INFO
from ddplab.guest import tensors

PRODUCTS = ("MmBackward0",)


def candidate(node, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, bool, object] | None:
    """(the detached operand as rows, whether it is the first operand, the node of the operand with a gradient) of
    a matrix product with exactly one operand carrying a gradient, fed by features the step gathered (``inputs``);
    None for anything else. Autograd saves only the operand the other's gradient needs: the detached one. Nothing
    saved is unpacked before the graph shows the gathered features (unpacking can recompute a checkpointed block)."""
    if node.name() not in PRODUCTS or len(node.next_functions) != 2:
        return None
    children = [child for child, _ in node.next_functions]
    if (children[0] is None) == (children[1] is None):
        return None
    child = children[0] if children[0] is not None else children[1]
    nodes = {id(t.grad_fn) for t in inputs if t.grad_fn is not None}
    if id(child) not in nodes and not (child.name() == "MulBackward0" and
                                       any(id(c) in nodes for c, _ in child.next_functions if c is not None)):
        return None
    try:
        operand = node._saved_mat2 if children[0] is not None else node._saved_self
    except RuntimeError:  # saved tensors already freed
        return None
    if not (isinstance(operand, torch.Tensor) and tensors.is_plain(operand) and operand.dim() == 2):
        return None
    if children[0] is not None:  # features @ gathered.T: the gathered rows are the second operand's columns
        return operand.T, False, child
    return operand, True, child  # gathered @ features.T


def watch(candidates: list, inputs: list[torch.Tensor], rank: int, size: int, site: str | None) -> None:
    """Hook the products whose detached operand holds, at this rank's place, the values of features this step
    gathered while they required grad (``inputs``): every rank's copy, its own detached among them."""
    audit = state.current()
    for node, (gathered, first, child) in candidates:
        if audit is None or "GATHERED_TERMS_MISSING" in audit.findings:
            return
        if gathered.shape[0] % size or gathered.shape[0] == 0:
            continue
        own = gathered.split(gathered.shape[0] // size)[rank]
        if any(own.shape == t.shape and torch.equal(own.detach(), t.detach()) for t in inputs):
            node.register_prehook(functools.partial(_received, gathered, first, _features(child, inputs), size,
                                                    site))


def _features(child, inputs: list[torch.Tensor]) -> torch.Tensor | None:
    """The product's operand with a gradient, where the graph holds it, up to a scale: a gathered input itself, or
    the features of ``logit_scale * features`` (whose product saves both; the scale is the same factor in what the
    product sends either operand, so it cancels in their ratio); None otherwise."""
    for tensor in inputs:
        if tensor.grad_fn is child:
            return tensor
    if child.name() == "MulBackward0":
        try:
            a, b = child._saved_self, child._saved_other
        except RuntimeError:
            return None
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (a.dim() == 0) != (b.dim() == 0):
            return b if a.dim() == 0 else a
    return None


def _received(gathered, first: bool, features, size: int, site, grad_outputs):
    _judge(gathered, first, features, size, site, grad_outputs)
    return None


@state.guarded("weighing a product with detached gathered features")
def _judge(audit, gathered, first: bool, features, size: int, site, grad_outputs) -> None:
    grad = grad_outputs[0] if grad_outputs else None
    if "GATHERED_TERMS_MISSING" in audit.findings or not (isinstance(grad, torch.Tensor) and tensors.is_plain(grad)):
        return
    grad = (grad.T if first else grad).detach()  # b×N: this rank's rows against every gathered row
    kept = grad @ gathered.detach().to(grad.dtype)
    kept_norm = float(kept.norm())
    if not kept_norm > 0:
        return
    measured = "the product received a nonzero gradient"
    if features is not None and features.shape == kept.shape:
        dropped = grad.T @ features.detach().to(grad.dtype)
        measured = (f"what the product would have sent the gathered copies had {float(dropped.norm()) / kept_norm:.3g} "
                    "times the norm of what it sent this rank's own features")
    where = f"the loss at {site}" if site else "the loss"
    # An info: a program that detaches the gathered copies on one process too (BLIP's concat_all_gather under
    # no_grad) computes on N ranks what it computes alone; one that gathers nothing alone (open_clip) does not.
    audit.add("GATHERED_TERMS_MISSING",
              f"{where} multiplies this rank's features by features gathered from the {size} ranks without "
              f"autograd, every gathered copy detached (this rank's own too: nothing put back); at step {audit.steps} "
              f"{measured}, and the gathered copies' share is dropped on every rank. Against one process that "
              "gathers nothing (open_clip at world size 1) the gradient lacks those terms; against one that detaches "
              "its copies too (a concat_all_gather under no_grad, as BLIP's) it is the same: ddplab check -- COMMAND "
              "compares the two", severity=INFO)
