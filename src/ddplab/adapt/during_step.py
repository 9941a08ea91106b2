"""An lr factor that holds for the length of each ``optimizer.step()`` only (torch's step hooks).

The factor is applied in a step pre-hook and the optimizer's own lr put back in the post-hook, so
whatever scheduler the optimizer has keeps computing its own lr undisturbed (no chained-scheduler
arithmetic). AdaScale's gain, the batch ramp's rule and the integrations' warmup all act this way.
"""

from __future__ import annotations

from collections.abc import Callable

from ddplab.errors import UsageError


def require_optimizer(optimizer) -> None:
    """A UsageError naming ``optimizer`` unless it has torch's step hooks and param groups."""
    if not (hasattr(optimizer, "register_step_pre_hook") and hasattr(optimizer, "param_groups")):
        raise UsageError(f"{{optimizer}} must be a torch.optim.Optimizer (its lr is scaled in its step hooks), got "
                         f"{type(optimizer).__name__}")


class LrDuringStep:
    """Each update of ``optimizer`` runs at ``factor()`` × every param group's lr.

    ``after(lr)`` is called once the optimizer's own lr is back, with the lr group 0 had during the update.
    """

    def __init__(self, optimizer, factor: Callable[[], float], after: Callable[[float], None] | None = None):
        self._factor, self._after_step = factor, after
        self._saved: list | None = None
        self._handles = [optimizer.register_step_pre_hook(self._before),
                         optimizer.register_step_post_hook(self._after)]

    def _before(self, optimizer, args, kwargs) -> None:
        factor = self._factor()
        self._saved = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor  # a new object: a tensor lr is never scaled in place

    def _after(self, optimizer, args, kwargs) -> None:
        applied = optimizer.param_groups[0]["lr"]
        if self._saved is not None:
            for group, saved in zip(optimizer.param_groups, self._saved):
                group["lr"] = saved
            self._saved = None
        if self._after_step is not None:
            self._after_step(applied)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
