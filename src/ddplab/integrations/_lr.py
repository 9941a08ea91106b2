"""Scaling an optimizer's lr together with its schedulers, and a warmup that composes with any scheduler."""

from __future__ import annotations

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
    """Goyal et al. gradual warmup as a factor on the lr during each optimizer update only.

    The factor is applied in a step pre-hook and removed in the post-hook, so whatever scheduler
    the optimizer has keeps computing its own lr undisturbed (no chained-scheduler arithmetic).
    """

    def __init__(self, optimizer, *, warmup_steps: int, lr_multiplier: float):
        self.warmup_steps, self.lr_multiplier = warmup_steps, lr_multiplier
        self.steps = 0
        self.applied: list[float] = []  # the lr of group 0 during each update, warmup included
        self._saved: list[float] | None = None
        self._handles = [optimizer.register_step_pre_hook(self._before), optimizer.register_step_post_hook(self._after)]

    def factor(self, step: int) -> float:
        return scaling.warmup_factor(step, warmup_steps=self.warmup_steps, lr_multiplier=self.lr_multiplier)

    def _before(self, optimizer, args, kwargs):
        factor = self.factor(self.steps)
        self._saved = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] *= factor
        self.applied.append(optimizer.param_groups[0]["lr"])

    def _after(self, optimizer, args, kwargs):
        if self._saved is not None:
            for group, lr in zip(optimizer.param_groups, self._saved):
                group["lr"] = lr
            self._saved = None
        self.steps += 1

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
