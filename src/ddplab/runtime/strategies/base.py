"""A parallelism strategy: how a model is wrapped on the ranks, and how its gradients are averaged.

Everything that trains, measures or audits a data-parallel model asks the model's strategy instead
of naming the wrapper's class: which process group averages the gradients (the data-parallel one,
which is not the world once tensor or pipeline ranks add no samples), how to accumulate without
reducing, where a rank's local gradient can be seen before the reduction and its share of the
reduced one after. A new strategy is one module with one subclass of :class:`Strategy`, added to
the registry in :mod:`ddplab.runtime.strategies`. (Lightning Fabric ``strategies/strategy.py``.)

The methods that take ``model`` read everything from the wrapped model itself, so they work on a
model the user wrapped in their own script as on one :meth:`Strategy.wrap` returned; only
:meth:`~Strategy.wrap` depends on the strategy's own fields (its options).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
import torch.distributed as dist

from ddplab.runtime.strategies.training import OptimizerFactory, Training, whole

if TYPE_CHECKING:
    from ddplab.runtime.launch import RankContext
    from ddplab.runtime.ranks import SpecFacts

LocalGradientPath = Literal["grad_hooks", "comm_hook"]
"""How a tap sees the local gradient: per-parameter hooks on ``.grad``, or the wrapper's communication hook."""


@dataclasses.dataclass
class GradientTap:
    """Where the local gradients are being watched from: the path taken and the hooks to remove."""

    via: LocalGradientPath
    handles: list = dataclasses.field(default_factory=list, repr=False)

    def remove(self) -> None:
        """Stop watching (a communication hook stays for the wrapper's life: torch cannot remove one)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


class Strategy(abc.ABC):
    """One way of training a model on several ranks (``ddp``, ``fsdp``, ``hsdp``), as one value."""

    name: ClassVar[str]
    """The name it is registered and chosen by."""
    collective_forward: ClassVar[bool] = False
    """Whether a forward through the user's module (:meth:`module`) is a collective, which every rank must run."""
    owns_optimizer: ClassVar[bool] = False
    """Whether its engine builds and steps the optimizer (DeepSpeed's): then only :meth:`training` trains with it."""
    taps_local_gradients: ClassVar[bool] = True
    """Whether :meth:`tap_local_gradients` serves (what ddplab's noise scale and AdaScale read on the ranks)."""
    reduces_float64: ClassVar[bool] = True
    """Whether it reduces float64 gradients (DeepSpeed's engine reduces float32 at most: the ranks train in it)."""

    def check_runnable(self, world_size: int) -> None:
        """Raise UsageError, before any rank starts, where this strategy cannot train on ``world_size`` ranks here."""
        return None  # any number of ranks, unless a strategy says otherwise

    @abc.abstractmethod
    def wrap(self, model: torch.nn.Module, ctx: RankContext, facts: SpecFacts | None = None) -> torch.nn.Module:
        """``model`` (already on ``ctx.device``) made ready to train on the ranks; forward goes through the result.

        ``facts`` are what a trial step of the spec found (parameters that get no gradient), when there was one.
        """

    def training(self, model: torch.nn.Module, make_optimizer: OptimizerFactory, ctx: RankContext,
                 facts: SpecFacts | None = None, *, accumulation_steps: int = 1,
                 per_device_batch_size: int | None = None) -> Training:
        """``model`` wrapped, with the optimizer ``make_optimizer`` builds on its parameters, ready for K micro-batches
        a step of ``per_device_batch_size`` each (:mod:`ddplab.runtime.strategies.training`); an engine that owns the
        optimizer builds it its own way."""
        wrapped = self.wrap(model, ctx, facts)
        return WrappedTraining(self, wrapped, make_optimizer(wrapped.parameters()), accumulation_steps)

    @abc.abstractmethod
    def owns(self, model) -> bool:
        """Whether ``model`` is a model this strategy wrapped, here or in the user's own script."""

    @abc.abstractmethod
    def module(self, model) -> torch.nn.Module:
        """The user's module inside ``model``: the one whose parameters the optimizer updates."""

    @abc.abstractmethod
    def data_parallel_group(self, model) -> dist.ProcessGroup:
        """The process group whose ranks train on different samples and average their gradients."""

    def data_parallel_size(self, model) -> int:
        """Ranks in the data-parallel group: the factor between the per-device and the global batch."""
        return dist.get_world_size(self.data_parallel_group(model))

    def data_parallel_rank(self, model) -> int:
        """This rank's place in the data-parallel group (what a sampler splits the data by)."""
        return dist.get_rank(self.data_parallel_group(model))

    def divide_factors(self, model) -> set[float]:
        """What the reduction divides the sum of the ranks' gradients by: the data-parallel size for an average."""
        return {float(self.data_parallel_size(model))}

    @abc.abstractmethod
    def no_sync(self, model) -> AbstractContextManager[None]:
        """Backward passes inside add to the local gradients without the data-parallel reduction (accumulation)."""

    @abc.abstractmethod
    def syncs(self, model) -> bool:
        """Whether a backward now reduces the gradients over the data-parallel group (False inside no_sync)."""

    def syncs_buffers(self, model) -> bool:
        """Whether the forward about to run makes the module's buffers equal across the group (DDP's broadcast)."""
        return False

    @abc.abstractmethod
    def tap_local_gradients(self, model, params: list[torch.Tensor], observe: Callable[[torch.Tensor], None], *,
                            via: Literal["auto", "grad_hooks", "comm_hook"] = "auto", comm_hook=None,
                            state=None) -> GradientTap:
        """Call ``observe(tensor)`` with each piece of this rank's local gradient of ``params``, before the reduction.

        Called only in backward passes that reduce (never inside :meth:`no_sync`); together the pieces of one
        backward hold every element of the local gradient once. ``observe`` must not change the tensor, nor keep
        it: the reduction overwrites it. Training stays what it is without the tap, bit for bit. ``via`` picks
        the path where a strategy has several; ``comm_hook`` and ``state`` are the user's own communication hook,
        which a tap on that path wraps. A combination the strategy cannot serve raises UsageError.
        """

    @abc.abstractmethod
    def reduced_gradient_share(self, model, params: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        """This rank's share of the reduced gradient of ``params``, read after a reducing backward.

        The shares of the ranks of the data-parallel group are disjoint and together the whole averaged
        gradient, so the sum of their squared norms over the group is its squared norm, counted once.
        """


class WrappedTraining(Training):
    """A model the strategy wrapped, stepped by the caller's optimizer: no_sync on all but the last micro-batch."""

    def __init__(self, strategy: Strategy, wrapped: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 accumulation_steps: int):
        self.strategy, self.model, self.optimizer = strategy, wrapped, optimizer
        self.accumulation_steps = accumulation_steps

    @property
    def module(self) -> torch.nn.Module:
        return self.strategy.module(self.model)

    def micro_batch(self, *, last: bool) -> contextlib.AbstractContextManager[None]:
        # DDP's no_sync must hold the forward too: its reducer is prepared there.
        return contextlib.nullcontext() if last else self.strategy.no_sync(self.model)

    def backward(self, loss: torch.Tensor, *, parts: int) -> None:
        (loss if parts == 1 else loss / parts).backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def gradients(self) -> list[torch.Tensor]:
        return [whole(p.grad if p.grad is not None else torch.zeros_like(p)).detach() for p in self.module.parameters()]

    def parameters(self) -> list[torch.Tensor]:
        return [whole(p.detach()) for p in self.module.parameters()]

    def divide_factors(self) -> set[float]:
        return self.strategy.divide_factors(self.model)


def flat_shares(tensors: Iterable[torch.Tensor | None], rank: int, world_size: int) -> Iterator[torch.Tensor]:
    """Rank ``rank``'s contiguous slice of each flattened tensor (ceil(numel / world_size) elements, the last short)."""
    for tensor in tensors:
        if tensor is None:
            continue
        flat = tensor.reshape(-1)
        share = -(-flat.numel() // world_size)
        yield flat[rank * share:(rank + 1) * share]

