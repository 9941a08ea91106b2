"""A global batch changed by accumulation steps while training runs, with an lr factor that follows it.

What :class:`~ddplab.adapt.ramp.BatchRamp` (driven by the measured noise scale) and
:class:`~ddplab.adapt.schedule.BatchSchedule` (driven by a schedule of samples seen) share: the
per-device batch and the world size stay fixed and the global batch W·b·A changes with the
accumulation steps A, so the loader and its DistributedSampler go on unchanged; the loop puts every
micro-batch of a window but the last under ``no_sync``; the lr factor moves linearly from the old
value to the new over ``warmup_steps`` optimizer steps after each change, applied during each
``optimizer.step()`` only (step hooks), so the optimizer's scheduler keeps its own lr.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

from ddplab.adapt.during_step import LrDuringStep
from ddplab.runtime import strategies


class AccumulatedBatch:
    """The accumulation window, the step count and the warmed-up lr factor; subclasses decide when to change.

    A subclass validates its own arguments, then calls this ``__init__`` last (it registers the
    optimizer's hooks), and overrides :meth:`_stepped`, called after each optimizer step.
    """

    def __init__(self, ddp_model, optimizer, *, accumulation_steps: int, samples_per_micro_step: int,
                 warmup_steps: int, lr_factor: float = 1.0):
        # The model weakly: the optimizer's hooks hold this object, which must not keep the model (and its process
        # group) alive past the user's loop.
        self._ddp_model = weakref.ref(ddp_model)
        self.optimizer, self.warmup_steps = optimizer, warmup_steps
        self.accumulation_steps, self.samples_per_micro_step = accumulation_steps, samples_per_micro_step
        self.steps, self.micro_steps = 0, 0
        self._from_factor = self._to_factor = lr_factor
        self._changed_at = 0
        self._during_step = LrDuringStep(optimizer, self.lr_factor, self._after)

    @property
    def ddp_model(self):
        """The model whose batch this changes (None once the training loop has let it go)."""
        return self._ddp_model()

    @property
    def global_batch_size(self) -> int:
        return self.samples_per_micro_step * self.accumulation_steps

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """One micro-step: under ``no_sync`` unless it closes the window (then DDP all-reduces)."""
        last = self.micro_steps + 1 >= self.accumulation_steps
        with contextlib.nullcontext() if last else strategies.no_sync(self.ddp_model):
            yield
        self.micro_steps += 1

    def should_step(self) -> bool:
        """True once the window's micro-steps are done: step and zero the gradients now."""
        if self.micro_steps < self.accumulation_steps:
            return False
        self.micro_steps = 0
        return True

    def lr_factor(self) -> float:
        """The factor on the optimizer's lr for the next update: the current batch's, warmed up after a change."""
        if self.warmup_steps == 0 or self.steps - self._changed_at + 1 >= self.warmup_steps:
            return self._to_factor
        # The first update after a change is 1/warmup_steps of the way; the warmup_steps-th is at the new lr.
        done = (self.steps - self._changed_at + 1) / self.warmup_steps
        return self._from_factor + (self._to_factor - self._from_factor) * done

    def _change(self, accumulation_steps: int, lr_factor: float) -> None:
        """Train at ``accumulation_steps`` from the next window on, the lr warming toward ``lr_factor``."""
        # The lr starts its ramp from wherever it is now (a change during a warmup continues from there).
        self._from_factor, self._to_factor = self.lr_factor(), lr_factor
        self._changed_at = self.steps
        self.accumulation_steps = accumulation_steps

    def _after(self, lr: float) -> None:
        self.steps += 1
        self._stepped()

    def _stepped(self) -> None:
        """After each optimizer step the hooks saw (a step GradScaler skips never gets here)."""

    def _warmup_state(self) -> dict:
        return {"steps": self.steps, "changed_at": self._changed_at, "from_factor": self._from_factor,
                "to_factor": self._to_factor}

    def _load_warmup_state(self, state: dict) -> None:
        self.steps, self._changed_at = state["steps"], state["changed_at"]
        self._from_factor, self._to_factor = state["from_factor"], state["to_factor"]
        self.micro_steps = 0

    def remove(self) -> None:
        """Stop adapting: the optimizer's own lr from here on (the batch stays where it is)."""
        self._during_step.remove()
