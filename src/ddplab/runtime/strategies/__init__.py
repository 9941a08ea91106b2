"""Parallelism strategies, registered by name: how a model is wrapped on the ranks and its gradients averaged.

    strategy = strategies.get("hsdp", replicate=2)
    model = strategy.wrap(model, ctx, facts)           # on the rank, inside a launch
    with strategy.no_sync(model):                      # accumulate without reducing
        loss_fn(model(x), y).backward()

A model wrapped in the user's own script finds its strategy with :func:`of`. Adding a strategy is one
module with one :class:`~ddplab.runtime.strategies.base.Strategy` subclass, and its entry below.
"""

from __future__ import annotations

import contextlib
import dataclasses
from contextlib import AbstractContextManager

from ddplab.errors import UsageError
from ddplab.runtime.config import DEFAULT_STRATEGY
from ddplab.runtime.strategies.base import GradientTap, Strategy
from ddplab.runtime.strategies.ddp import DDPStrategy
from ddplab.runtime.strategies.deepspeed import DeepSpeedStrategy
from ddplab.runtime.strategies.fsdp import FSDPStrategy
from ddplab.runtime.strategies.hsdp import HSDPStrategy

__all__ = ["DEFAULT", "STRATEGIES", "GradientTap", "Strategy", "get", "no_sync", "of"]

STRATEGIES: dict[str, Strategy] = {strategy.name: strategy
                                   for strategy in (DDPStrategy(), FSDPStrategy(), HSDPStrategy(), DeepSpeedStrategy())}
"""Every strategy by name, each with its default options."""

DEFAULT = DEFAULT_STRATEGY
"""The strategy a command trains with."""


def get(name: str = DEFAULT, **options) -> Strategy:
    """The strategy called ``name``, with ``options`` (its dataclass fields) changed from their defaults."""
    strategy = STRATEGIES.get(name)
    if strategy is None:
        raise UsageError(f"the strategy must be one of {', '.join(sorted(STRATEGIES))}, got {name!r}")
    known = {field.name for field in dataclasses.fields(strategy)}
    for option in options.keys() - known:
        raise UsageError(f"{{{option}}} is not an option of the {name} strategy")
    return dataclasses.replace(strategy, **options) if options else strategy


def of(model) -> Strategy | None:
    """The strategy that wrapped ``model`` (here or in the user's script); None for a plain module (one process)."""
    return next((strategy for strategy in STRATEGIES.values() if strategy.owns(model)), None)


def no_sync(model) -> AbstractContextManager[None]:
    """``model``'s strategy's no_sync; nothing to skip on a plain module (or a model already freed: None)."""
    strategy = of(model)
    return strategy.no_sync(model) if strategy is not None else contextlib.nullcontext()
