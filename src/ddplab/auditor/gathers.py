"""Losses over features all-gathered from every rank (SimCLR, CLIP): GATHERED_LOSS_WITHOUT_WORLD_SIZE.

Each rank gathers every rank's features and computes the same loss over all of them; only its own rows carry a
gradient back to its parameters. A gather whose backward passes back only this rank's slice of the gradient (the
usual ``GatherLayer``, an ``autograd.Function`` around ``dist.all_gather``) drops what the other ranks' losses owe
this rank's rows, so after DDP's average the gradient is 1/W of one process's, unless the loss is multiplied by W.
``torch.distributed.nn.functional.all_gather`` all-reduces in backward, and its gradient is exact.

Judged by evidence: once the program gathers a tensor that requires grad in the audited window, a hook on each custom
autograd function near the loss compares what its backward returned with its slice of what it received. The
hook returns None (the gradient is unchanged) and reads plain tensors only.

A gather without autograd (``dist.all_gather`` into a list, this rank's own features put back in its place with
their graph, then ``torch.cat``: open_clip's default) leaves a cat whose only input with a gradient is this rank's
slice. A hook on it copies a few elements of what every slice received; at the merge (:mod:`.slice_shares`) each
rank's slice is compared with the sum every rank's loss sent it: one share, 1/W, is the same loss on every rank
(a 1/W scale on the parameters behind the slice); shares that differ are terms missing.
"""

from __future__ import annotations

import collections
import functools
import math
import weakref

import torch
import torch.distributed as dist

from ddplab.auditor import collectives, detached, scales, state
from ddplab.guest import tensors
from ddplab.guest.patches import Patches

GATHERS = ("all_gather", "all_gather_into_tensor")
PUT_BACK = ("CatBackward", "StackBackward")
SAMPLES = 16  # elements of each slice's gradient copied for the merge
MAX_SLICE_RECORDS = 32
PARAMETER_SEARCH = 4096  # autograd nodes walked, once per run, to name the parameters behind a put-back slice


def install(patches: Patches) -> None:
    collectives.watch(_on_collective)


def _on_collective(name: str, args: tuple, kwargs: dict, caller: str) -> None:
    if name in GATHERS:
        _note_gather(args, kwargs)


@state.guarded("watching an all_gather")
def _note_gather(audit, args, kwargs) -> None:
    tensor = args[1] if len(args) > 1 else kwargs.get("tensor", kwargs.get("input_tensor"))
    if not (audit.armed and isinstance(tensor, torch.Tensor) and tensor.is_floating_point()):
        return
    group = kwargs.get("group", args[2] if len(args) > 2 else None)
    # A detached copy gathered (its own slice put back later) is watched for the put-back cat only.
    grad = tensor.requires_grad or bool(audit.gathered and audit.gathered[2])
    audit.gathered = (dist.get_rank(group), dist.get_world_size(group), grad)
    if tensor.requires_grad and len(audit.gather_inputs) < MAX_SLICE_RECORDS:
        audit.gather_inputs.append(weakref.ref(tensor))


def before_backward(audit, root, terms: list[scales.Reached]) -> None:
    """Backward from a loss in a step that gathered features: watch the custom functions between them."""
    if audit.gathered is None:
        return
    rank, size, custom = audit.gathered
    loss = next((term for term in terms if term.record.divide_by_count or term.record.summed), None)
    backward, audit.gather_backwards = audit.gather_backwards, audit.gather_backwards + 1
    # The features this step gathered while they required grad (open_clip's dist.all_gather of its own features).
    inputs = [tensor for ref in audit.gather_inputs if (tensor := ref()) is not None]
    put_back, products = [], []
    for node in _nodes([root], scales.SEARCH_NODES):
        if custom and isinstance(node, torch.autograd.function.BackwardCFunction):
            node.register_hook(functools.partial(_compared, loss, rank, size, type(node).__name__))
        elif _puts_back(node, rank, size):
            put_back.append(node)
        elif inputs and (operands := detached.candidate(node, inputs)) is not None:
            products.append((node, operands))
    site = loss.record.site if loss is not None else None
    if products and size > 1:
        detached.watch(products, inputs, rank, size, site)
    if not put_back:
        return
    if audit.gather_split is None:
        audit.gather_split = _parameters_split(audit, root, put_back, rank)
    for node in put_back:
        node.register_hook(functools.partial(_sampled, backward, rank, size, _compensated(terms, size), site,
                                             node.name(), int(getattr(node, "_saved_dim", 0))))


def _puts_back(node, rank: int, size: int) -> bool:
    """A cat (or stack) of one slice per rank where only this rank's own slice carries a gradient."""
    if size < 2 or not node.name().startswith(PUT_BACK) or len(node.next_functions) != size:
        return False
    carrying = [index for index, (child, _) in enumerate(node.next_functions) if child is not None]
    return carrying == [rank]


def _compensated(terms: list[scales.Reached], size: int) -> bool | None:
    """Whether the loss was multiplied by the world size (True), was not (False), or cannot be told (None): a term
    scaled by a tensor, by a Python float (``* float(W)``) or summed (``reduction='sum') / b`` is W/b·mean) is
    not judged."""
    if not terms or any(term.scale is None or term.python_floats or term.record.summed for term in terms):
        return None
    return any(multiplier % size == 0 for term in terms for multiplier in term.multipliers)


def _parameters_split(audit, root, put_back: list, rank: int) -> dict:
    """The parameters whose gradient comes only through this rank's put-back slices, and those reached only outside
    every gather (named as the model names them)."""
    names = {id(p): name for info in list(audit.wrappers.values()) for name, p in info.params()}
    through = _parameters(child for node in put_back for child, _ in node.next_functions[rank:rank + 1])
    outside = _parameters([root], avoid={id(node) for node in put_back})
    return {"through": [names.get(i, "?") for i in through if i not in outside],
            "outside": [names.get(i, "?") for i in outside if i not in through]}


def _parameters(roots, avoid: frozenset | set = frozenset()) -> list[int]:
    """ids of the parameters (leaves) backward reaches from ``roots``, in the order reached."""
    found = {}
    for node in _nodes(roots, PARAMETER_SEARCH, avoid):
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            found.setdefault(id(variable), None)
    return list(found)


def _nodes(roots, limit: int, avoid: frozenset | set = frozenset()):
    """The autograd nodes backward reaches from ``roots``, breadth first, each once, at most ``limit`` of them
    (``avoid``: nodes neither visited nor walked through)."""
    seen, frontier = set(avoid), collections.deque(roots)
    while frontier and len(seen) < limit:
        node = frontier.popleft()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        frontier.extend(child for child, _ in node.next_functions)


def _sampled(backward: int, rank: int, size: int, compensated, site, name: str, dim: int, grad_inputs, grad_outputs):
    _sample(backward, rank, size, compensated, site, name, dim, grad_outputs)
    return None


@state.guarded("copying a gathered slice's gradient")
def _sample(audit, backward: int, rank: int, size: int, compensated, site, name: str, dim: int, grad_outputs) -> None:
    received = grad_outputs[0] if grad_outputs else None
    if not (isinstance(received, torch.Tensor) and tensors.is_plain(received)) or \
            len(audit.gathered_slices) >= MAX_SLICE_RECORDS:
        return
    if name.startswith("StackBackward"):
        pieces = received.unbind(dim)
    elif received.dim() and received.shape[dim] % size == 0:
        pieces = received.split(received.shape[dim] // size, dim)
    else:
        return
    shape = list(pieces[0].shape)
    count = pieces[0].numel()
    if not count:
        return
    positions = torch.linspace(0, count - 1, min(SAMPLES, count)).round().long().to(received.device)
    ordinal = sum(1 for entry in audit.gathered_slices
                  if entry["step"] == audit.steps and entry["backward"] == backward and entry["shape"] == shape)
    audit.gathered_slices.append({
        "step": audit.steps, "backward": backward, "shape": shape, "ordinal": ordinal, "kept": rank, "size": size,
        "samples": [piece.detach().reshape(-1)[positions].double().cpu().tolist() for piece in pieces],
        "compensated": compensated, "site": site, **(audit.gather_split or {})})


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
