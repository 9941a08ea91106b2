"""Scaling an optimizer's lr together with its schedulers, and a warmup that composes with any scheduler."""

from __future__ import annotations

from ddplab.adapt.during_step import LrDuringStep
from ddplab.plan import scaling


def scale_optimizer(optimizer, schedulers, factor: float) -> None:
    """Multiply the lr by ``factor`` everywhere a scheduler keeps it: lr, initial_lr, base_lrs and _last_lr.

    Scaling ``lr`` alone is undone by the scheduler's next step, which starts again from ``base_lrs``.
    """
    for group in optimizer.param_groups:
        group["lr"] *= factor
        if "initial_lr" in group:
            group["initial_lr"] *= factor
    for scheduler in schedulers:
        if getattr(scheduler, "optimizer", None) is not optimizer:
            continue
        if hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
        if hasattr(scheduler, "_last_lr"):
            scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


class Warmup:
    """Goyal et al. gradual warmup as a factor on the lr during each optimizer update only
    (:class:`ddplab.adapt.during_step.LrDuringStep`), so the optimizer's scheduler runs undisturbed."""

    def __init__(self, optimizer, *, warmup_steps: int, lr_multiplier: float):
        self.warmup_steps, self.lr_multiplier = warmup_steps, lr_multiplier
        self.steps = 0
        self.applied: list[float] = []  # the lr of group 0 during each update, warmup included
        self._during_step = LrDuringStep(optimizer, lambda: self.factor(self.steps), self._after)

    def factor(self, step: int) -> float:
        return scaling.warmup_factor(step, warmup_steps=self.warmup_steps, lr_multiplier=self.lr_multiplier)

    def _after(self, lr: float) -> None:
        self.applied.append(lr)
        self.steps += 1

    def remove(self) -> None:
        self._during_step.remove()
