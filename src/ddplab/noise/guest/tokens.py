"""A language model's tokens, counted where its loss counts them: the class-index targets of ``cross_entropy`` and
``nll_loss`` that are not ``ignore_index`` (padding and masked labels weigh nothing in the loss, so they are no
tokens of the batch), read from each call's own arguments as the audit reads them
(:func:`ddplab.auditor.loss_functions.class_targets`).

Counted only inside a measured step, after one of its training forwards, for a loss that reaches autograd
(evaluation under ``no_grad`` is left out), and only for a 'mean' or 'sum' reduction (with 'none' the program
decides what it keeps after the call). The count stays a tensor on its device until the step's record is written,
which already synchronises. Whether the counted losses were a token loss (one call per training forward, over more
targets than samples) is decided when the ranks' records are merged (:mod:`ddplab.noise.command.merge`).
"""

from __future__ import annotations

import functools

import torch

from ddplab.auditor import loss_functions
from ddplab.guest.patches import Patches
from ddplab.noise.guest import state
from ddplab.noise.guest.state import GuestState

LOSS_FUNCTIONS = ("cross_entropy", "nll_loss")


class TokenCount:
    """A measured step's calls of a class-index loss: how many, over how many targets, keeping how many."""

    def __init__(self):
        self.losses = self.targets = 0
        self.kept: torch.Tensor | None = None
        self.name: str | None = None

    def add(self, name: str, targets: loss_functions.ClassTargets) -> None:
        self.losses += 1
        self.targets += targets.shape.numel()
        kept = targets.kept.detach().to(torch.float64)
        self.kept = kept if self.kept is None else self.kept + kept
        self.name = name

    def fields(self) -> dict:
        """The step record's fields (``tokens``: the kept targets)."""
        return {"token_losses": self.losses, "token_loss": self.name, "targets": self.targets,
                "tokens": None if self.kept is None else int(self.kept.item())}


def patch(patches: Patches) -> None:
    """Count the targets of every call of the class-index losses (the call itself goes through unchanged)."""
    for name in LOSS_FUNCTIONS:
        patches.replace(torch.nn.functional, name, functools.partial(_watched, name))


def _watched(name: str, original):
    @functools.wraps(original)
    def loss_function(*args, **kwargs):
        out = original(*args, **kwargs)
        _count(name, original, args, kwargs, out)
        return out

    return loss_function


@state.guarded("counting a loss's tokens")
def _count(guest: GuestState, name: str, function, args, kwargs, out) -> None:
    measurement = guest.measurement
    if measurement is None or not measurement.forwards or not (isinstance(out, torch.Tensor) and out.requires_grad):
        return
    targets = loss_functions.class_targets(name, function, args, kwargs)
    # Tokens are (batch, positions) or flattened positions; a per-pixel target (batch, height, width) is not.
    if targets is not None and len(targets.shape) <= 2:
        measurement.tokens.add(name, targets)
