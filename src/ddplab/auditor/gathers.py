"""Losses over features all-gathered from every rank (SimCLR, CLIP): GATHERED_LOSS_WITHOUT_WORLD_SIZE.

Each rank gathers every rank's features and computes the same loss over all of them; only its own rows carry a
gradient back to its parameters. A gather whose backward passes back only this rank's slice of the gradient (the
usual ``GatherLayer``, an ``autograd.Function`` around ``dist.all_gather``) drops what the other ranks' losses owe
this rank's rows, so after DDP's average the gradient is 1/W of one process's, unless the loss is multiplied by W.
``torch.distributed.nn.functional.all_gather`` all-reduces in backward, and its gradient is exact.

Judged by evidence: once the program gathers a tensor that requires grad in the audited window, a hook on each custom
autograd function near the loss compares what its backward returned with its slice of what it received. The
hook returns None (the gradient is unchanged) and reads plain tensors only.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from ddplab.auditor import collectives, scales, state
from ddplab.guest import tensors
from ddplab.guest.patches import Patches

GATHERS = ("all_gather", "all_gather_into_tensor")


def install(patches: Patches) -> None:
    collectives.watch(_on_collective)


def _on_collective(name: str, args: tuple, kwargs: dict, caller: str) -> None:
    if name in GATHERS:
        _note_gather(args, kwargs)


@state.guarded("watching an all_gather")
def _note_gather(audit, args, kwargs) -> None:
    tensor = args[1] if len(args) > 1 else kwargs.get("tensor", kwargs.get("input_tensor"))
    if not (audit.armed and isinstance(tensor, torch.Tensor) and tensor.requires_grad):
        return
    group = kwargs.get("group", args[2] if len(args) > 2 else None)
    audit.gathered = (dist.get_rank(group), dist.get_world_size(group))


def before_backward(audit, root, terms: list[scales.Reached]) -> None:
    """Backward from a loss in a step that gathered features: watch the custom functions between them."""
    if audit.gathered is None:
        return
    rank, size = audit.gathered
    loss = next((term for term in terms if term.record.divide_by_count or term.record.summed), None)
    seen, frontier = set(), [root]
    while frontier and len(seen) < scales.SEARCH_NODES:
        node = frontier.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            node.register_hook(functools.partial(_compared, loss, rank, size, type(node).__name__))
        frontier.extend(child for child, _ in node.next_functions)


def _compared(loss, rank: int, size: int, name: str, grad_inputs, grad_outputs):
    _judge(loss, rank, size, name, grad_inputs, grad_outputs)
    return None


@state.guarded("comparing a gather's backward")
def _judge(audit, loss, rank: int, size: int, name: str, grad_inputs, grad_outputs) -> None:
    returned = grad_inputs[0] if grad_inputs else None
    parts = _slices(returned, grad_outputs, size)
    if parts is None or "GATHERED_LOSS_WITHOUT_WORLD_SIZE" in audit.findings:
        return
    own, others = parts[rank], [part for index, part in enumerate(parts) if index != rank]
    if not (torch.equal(returned, own) and any(bool(part.any()) for part in others)):
        return  # it returned more than its own slice (an all-reduce): the gradient is exact
    scale = None if loss is None else loss.scale
    if scale is None or not math.isclose(abs(scale), 1.0, rel_tol=1e-6):
        return  # the loss is scaled (× W, or by a count): no evidence of a missing factor
    audit.add("GATHERED_LOSS_WITHOUT_WORLD_SIZE",
              f"the loss at {loss.record.site} was computed over features {name.removesuffix('Backward')} gathered "
              f"from the {size} ranks, and its backward returned only rank {rank}'s slice of the gradient it "
              f"received, unscaled (the loss is not multiplied by {size})")


def _slices(returned, grad_outputs, size: int) -> list[torch.Tensor] | None:
    """What the gather's backward received, as one slice per rank shaped like what it returned; None for a
    function that is no gather of ``returned``'s shape."""
    if not (isinstance(returned, torch.Tensor) and tensors.is_plain(returned)):
        return None
    received = [g for g in grad_outputs if isinstance(g, torch.Tensor)]
    if not all(tensors.is_plain(g) for g in received):
        return None
    if len(received) == size and all(g.shape == returned.shape for g in received):
        return received
    if len(received) == 1 and returned.dim() and received[0].shape[1:] == returned.shape[1:] and \
            received[0].shape[0] == size * returned.shape[0]:
        return list(received[0].split(returned.shape[0]))
    return None
