"""What trains a model on the ranks: the model forward goes through, its optimizer, a micro-batch's backward, the step.

Most strategies wrap the model and leave the optimizer to the caller (``base.WrappedTraining``); DeepSpeed's engine
owns both, and divides each micro-batch's loss by the accumulation steps itself. Every loop that trains a spec on the
ranks goes through one, so it reads the same on every strategy:

    training = strategy.training(model, make_optimizer, ctx, facts, accumulation_steps=K)
    for index, batch in enumerate(micro_batches):
        with training.micro_batch(last=index == K - 1):
            training.backward(loss_fn(training.model(x), y), parts=K)
    gradients = training.gradients()       # whole, reduced: before the step
    training.step()
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator

import torch

OptimizerFactory = Callable[[object], torch.optim.Optimizer]
"""Builds the optimizer from the parameters it updates (a spec's ``optimizer(params)``)."""


class Training(abc.ABC):
    """One model trained on the ranks with its optimizer: K micro-batches' backward passes, then one step."""

    model: torch.nn.Module
    """What the forward goes through (the wrapper, the engine)."""
    accumulation_steps: int

    @property
    @abc.abstractmethod
    def module(self) -> torch.nn.Module:
        """The user's module inside :attr:`model`."""

    @abc.abstractmethod
    def micro_batch(self, *, last: bool) -> contextlib.AbstractContextManager[None]:
        """Around one micro-batch's forward and backward; the gradients are reduced on the ``last`` only."""

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor, *, parts: int) -> None:
        """Backward through one micro-batch's mean loss, weighed 1/``parts`` among this step's ``parts`` micro-batches
        (fewer than :attr:`accumulation_steps` where an epoch ends in a partial step)."""

    @abc.abstractmethod
    def step(self) -> None:
        """The optimizer's step after the last micro-batch; the gradients are cleared for the next."""

    @abc.abstractmethod
    def gradients(self) -> list[torch.Tensor]:
        """Every parameter's whole reduced gradient (zeros where it has none), after the last backward, before
        :meth:`step`; a collective where they are sharded: every rank calls it."""

    @abc.abstractmethod
    def parameters(self) -> list[torch.Tensor]:
        """Every parameter whole; a collective where they are sharded: every rank calls it."""

    @abc.abstractmethod
    def divide_factors(self) -> set[float]:
        """What the reduction divided the sum of the ranks' gradients by (the data-parallel size: an average)."""

    def close(self) -> None:
        """Let go of what the strategy holds for this model (hooks on it); nothing by default."""
        return None


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded tensor (FSDP2's DTensor) gathered whole, on every rank of its mesh (a collective); else itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def flat(tensors: Iterator[torch.Tensor] | list[torch.Tensor]) -> torch.Tensor:
    """The tensors flattened into one float64 vector on the CPU."""
    return torch.cat([t.reshape(-1).to("cpu", torch.float64) for t in tensors])
