"""What multiplies a loss's terms between where they were reduced and where backward starts: the autograd path.

A loss that reaches backward is often a sum of terms, each scaled: ``recon + 0.1 * (-0.5 * kl.sum())``,
``loss_sum * world_size / count``, ``loss / accumulation_steps``. Walking the graph from backward's root through
the nodes that only scale or add 0-dim values (products and divisions by a number, negations, sums of terms,
casts and views) reaches each tagged term (a loss function's output, a full sum written by hand: their autograd
nodes carry a record in ``metadata``) with the product of the numbers on its way.

Each number is one of three kinds, told apart by how torch holds it: a Python float (a 0-dim float64 tensor on
the CPU, beside a loss of another dtype: a constant such as β, −½, a temperature), an integer (the world size, the
accumulation steps, a batch size, or a count: indistinguishable), or a tensor of the program's (a count it
all-reduced, on any device). Only a path of Python floats and integers has a scale known without reading the
program's data; a tensor on the way makes the scale data-dependent, which is what dividing by a count is.
Nothing here changes the graph, and a tensor on an accelerator is never read (no synchronisation).
"""

from __future__ import annotations

import dataclasses

import torch

# The record a tagged node carries (:mod:`ddplab.auditor.weights`).
RECORD = "ddplab_record"
# Nodes visited from one root, at most.
SEARCH_NODES = 256
# Nodes that pass a 0-dim value on unchanged.
PASSING = ("ToCopyBackward", "ViewBackward", "ReshapeAliasBackward", "UnsafeViewBackward", "SqueezeBackward",
           "UnsqueezeBackward", "CloneBackward", "AliasBackward", "ExpandBackward", "StackBackward", "CatBackward",
           "SumBackward", "AddBackward1", "SubBackward1")


@dataclasses.dataclass(frozen=True)
class Reached:
    """A tagged term reached from backward's root, and what multiplies it on the way."""

    record: object
    scale: float | None
    """The product of the numbers on the way; None where a tensor of the program's (a count) is among them."""
    python_floats: bool
    """Whether any factor on the way was a Python float (a constant the program wrote, such as β or −½)."""
    multipliers: tuple[float, ...] = ()
    """The integers the term was multiplied by on the way (the world size, if the program scales by it)."""


def reached(root, loss_dtype: torch.dtype) -> list[Reached]:
    """Every tagged term on a linear path from ``root`` (the autograd node backward starts from)."""
    found: list[Reached] = []
    stack = [(root, 1.0, False, ())]
    visited = 0
    while stack and visited < SEARCH_NODES:
        node, scale, floats, multipliers = stack.pop()
        visited += 1
        if node is None:
            continue
        record = node.metadata.get(RECORD)
        if record is not None:
            found.append(Reached(record, scale, floats, multipliers))
            continue
        stack.extend((child, None if scale is None or factor is None else scale * factor, floats or is_float,
                      multipliers + _integer_multiplier(factor, is_float))
                     for child, factor, is_float in _children(node, loss_dtype))
    return found


def _integer_multiplier(factor: float | None, is_float: bool) -> tuple[float, ...]:
    """A factor that multiplies by an integer greater than 1 (a division's factor is below 1: never one)."""
    return (factor,) if factor is not None and not is_float and factor > 1 and float(factor).is_integer() else ()


def _children(node, loss_dtype: torch.dtype) -> list[tuple[object, float | None, bool]]:
    """(child, the factor it is multiplied by, whether that factor is a Python float) of a linear node; [] for any
    node that does more than scale or add (the path stops there)."""
    name = node.name()
    inputs = [child for child, _ in node.next_functions]
    if name.startswith("NegBackward") or name.startswith("RsubBackward"):
        return [(inputs[0], -1.0, False)]
    if name.startswith(("AddBackward0", "SubBackward0")):
        alpha = float(getattr(node, "_saved_alpha", 1) or 1)
        second = -alpha if name.startswith("Sub") else alpha
        return [(child, factor, False) for child, factor in zip(inputs, (1.0, second)) if child is not None]
    if name.startswith(PASSING):
        return [(child, 1.0, False) for child in inputs if child is not None]
    if name.startswith(("MulBackward0", "DivBackward0")):
        return _scaled(node, inputs, name.startswith("Div"), loss_dtype)
    return []


def _scaled(node, inputs: list, divides: bool, loss_dtype: torch.dtype) -> list[tuple[object, float | None, bool]]:
    """A product (or quotient) of a term and a number: the number's value and kind."""
    try:
        operands = (getattr(node, "_saved_self", None), getattr(node, "_saved_other", None))
    except RuntimeError:  # saved tensors already freed: nothing to read
        return []
    # One input carries the gradient; the other is the number (its input is None: no gradient flows to it).
    if len(inputs) != 2 or (inputs[0] is None) == (inputs[1] is None):
        return []
    number = operands[1] if inputs[0] is not None else operands[0]
    child = inputs[0] if inputs[0] is not None else inputs[1]
    if divides and inputs[0] is None:
        return []  # a number divided by the loss: no scale
    if not isinstance(number, torch.Tensor) or number.numel() != 1:
        return []
    value, is_float = _value(number, loss_dtype)
    if value is None:
        return [(child, None, False)]
    if divides and value == 0:
        return []
    return [(child, 1 / value if divides else value, is_float)]


def _value(number: torch.Tensor, loss_dtype: torch.dtype) -> tuple[float | None, bool]:
    """A number's value where it can be read without synchronising, and whether it is a Python float."""
    if number.device.type != "cpu":
        return None, False
    if number.dtype == torch.float64 and loss_dtype != torch.float64:
        return float(number), True
    if not number.is_floating_point() and not number.is_complex() and number.dtype != torch.bool:
        return float(number), False  # an integer: the world size, accumulation steps, a batch size, or a count
    return None, False  # a float tensor of the program's: a count, or a scale it computed
