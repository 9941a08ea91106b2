"""A global batch that grows with the measured noise scale, by accumulation steps (McCandlish et al. 2018).

    gns = GradientNoiseScale(ddp_model, per_device_batch_size=32, every=1)
    ramp = BatchRamp(ddp_model, optimizer, gns, max_accumulation_steps=16, rule="linear", warmup_steps=20)
    for x, y in loader:
        with ramp.accumulate():                    # no_sync on every micro-batch but a window's last
            (loss_fn(ddp_model(x), y) / ramp.accumulation_steps).backward()
        if ramp.should_step():
            gns.step()                             # the measurement the ramp reads
            optimizer.step()                       # at the rule's lr for the current global batch
            optimizer.zero_grad()

The per-device batch and the world size stay fixed; the global batch W·b·A grows by raising the
accumulation steps A, so the loader and its DistributedSampler go on exactly as they were: no sample
is skipped or repeated when the batch changes mid-epoch (a window may run over an epoch's end). The
target is the measured B_simple (the noise scale's running estimate, the same on every rank since
it comes from an all-reduce): after each step, once ``interval`` measured steps have passed since
the last change, A grows to the smallest value whose global batch reaches ``target_ratio`` ×
B_simple, never shrinking, at most ``max_accumulation_steps``. The lr follows ``rule`` from the
starting batch (linear ×k, square root ×√k, or none) and, after each jump, ramps linearly from the
old lr to the new over ``warmup_steps`` steps. The lr is applied during each ``optimizer.step()``
only (step hooks), so your scheduler keeps its own lr.

Gradient clipping: call ``gns.step()`` before clipping, so the measurement sees the true gradients. A
step GradScaler skips (an overflow) never reaches the optimizer's hooks: it neither advances the
ramp nor counts as a measurement (the noise scale leaves non-finite steps out). Checkpoints:
``state_dict()`` beside the optimizer's, restored with ``load_state_dict()`` (the starting batch
the rule scales from included).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from ddplab.adapt.accumulation import AccumulatedBatch
from ddplab.adapt.during_step import require_optimizer
from ddplab.errors import UsageError
from ddplab.validation import positive

RampRule = Literal["linear", "sqrt", "none"]


@dataclasses.dataclass(frozen=True)
class RampChange:
    """One growth of the global batch."""

    step: int
    """The optimizer step after which it changed (0-based)."""
    accumulation_steps: int
    global_batch_size: int
    b_simple: float
    """The measured B_simple that asked for it."""
    lr_factor: float
    """The rule's lr factor at this global batch, relative to the starting one."""


class BatchRamp(AccumulatedBatch):
    """Grow ``ddp_model``'s global batch with ``noise_scale``'s B_simple, and ``optimizer``'s lr with it.

    Args:
        ddp_model: the DistributedDataParallel model (or, on one process, the module) being trained.
        optimizer: the torch optimizer stepping it.
        noise_scale: the ``ddplab.GradientNoiseScale`` on ``ddp_model``; measure every step (``every=1``)
            or close to it. Its accumulation steps are the ramp's start.
        max_accumulation_steps: the most accumulation steps the ramp may reach (the largest global batch).
        rule: how the lr follows the global batch: "linear" (SGD), "sqrt" (Adam), or "none".
        warmup_steps: optimizer steps over which the lr moves to its new value after each jump.
        target_ratio: the global batch the ramp aims for, as a multiple of B_simple.
        interval: measured steps between two changes (the estimate must settle in between).
        grow_after_step: grow after any optimizer step (a plain loop); False leaves it to :meth:`grow`, for a
            framework that can change its accumulation only at set points (Lightning: an epoch's start).
    """

    def __init__(self, ddp_model, optimizer, noise_scale, *, max_accumulation_steps: int,
                 rule: RampRule = "linear", warmup_steps: int = 0, target_ratio: float = 1.0, interval: int = 10,
                 grow_after_step: bool = True):
        require_optimizer(optimizer)
        if not (hasattr(noise_scale, "history") and hasattr(noise_scale, "set_accumulation_steps")):
            raise UsageError(f"{{noise_scale}} must be a ddplab GradientNoiseScale, got {type(noise_scale).__name__}")
        start = noise_scale.accumulation_steps
        if not (isinstance(max_accumulation_steps, int) and max_accumulation_steps >= start):
            raise UsageError(f"{{max_accumulation_steps}} must be an integer at least the starting accumulation steps "
                             f"{start}, got {max_accumulation_steps}")
        # Global samples in one micro-step: world size × per-device batch.
        micro = noise_scale.b_big // start
        dataset_size = getattr(noise_scale, "dataset_size", None)
        if dataset_size is not None and max_accumulation_steps * micro > dataset_size:
            raise UsageError(f"{{max_accumulation_steps}} {max_accumulation_steps} makes a global batch of "
                             f"{max_accumulation_steps * micro}, more than the noise scale's {{dataset_size}} "
                             f"{dataset_size}: lower it to {dataset_size // micro} or less")
        if rule not in ("linear", "sqrt", "none"):
            raise UsageError(f"{{rule}} must be linear, sqrt or none, got {rule!r}")
        for name, value, low in (("warmup_steps", warmup_steps, 0), ("interval", interval, 1)):
            if not (isinstance(value, int) and value >= low):
                raise UsageError(f"{{{name}}} must be an integer ≥ {low}, got {value}")
        positive("target_ratio", target_ratio)
        self.noise_scale = noise_scale
        self.max_accumulation_steps, self.rule = max_accumulation_steps, rule
        self.target_ratio, self.interval = target_ratio, interval
        self.grow_after_step = grow_after_step
        self.start_accumulation_steps = start
        self.changes: list[RampChange] = []
        self._measured_at_change = len(noise_scale.history)
        super().__init__(ddp_model, optimizer, accumulation_steps=start, samples_per_micro_step=micro,
                         warmup_steps=warmup_steps)

    def _rule_factor(self, accumulation_steps: int) -> float:
        k = accumulation_steps / self.start_accumulation_steps
        return {"linear": k, "sqrt": math.sqrt(k), "none": 1.0}[self.rule]

    def _stepped(self) -> None:
        if self.grow_after_step:
            self.grow()

    def grow(self) -> bool:
        """Raise the accumulation steps if the measured B_simple asks for it; True when they changed."""
        measured = len(self.noise_scale.history) - self._measured_at_change
        b_simple = self.noise_scale.b_simple
        if measured < self.interval or not math.isfinite(b_simple) or b_simple <= 0:
            return False
        wanted = math.ceil(self.target_ratio * b_simple / self.samples_per_micro_step)
        grown = min(max(wanted, self.accumulation_steps), self.max_accumulation_steps)
        if grown == self.accumulation_steps:
            return False
        self._change(grown, self._rule_factor(grown))
        self.noise_scale.set_accumulation_steps(grown)
        self._measured_at_change = len(self.noise_scale.history)
        self.changes.append(RampChange(self.steps - 1, grown, self.global_batch_size, b_simple, self._to_factor))
        return True

    def state_dict(self) -> dict:
        """What a checkpoint needs to resume the same batch, lr factor and warmup."""
        return {"accumulation_steps": self.accumulation_steps, **self._warmup_state(),
                "start_accumulation_steps": self.start_accumulation_steps,
                "samples_per_micro_step": self.samples_per_micro_step,
                "changes": [dataclasses.asdict(c) for c in self.changes]}

    def load_state_dict(self, state: dict) -> None:
        # The rule scales from the run's first batch, not from the batch this noise scale was built at.
        self.start_accumulation_steps = state["start_accumulation_steps"]
        self.samples_per_micro_step = state["samples_per_micro_step"]
        self.accumulation_steps = state["accumulation_steps"]
        self.noise_scale.set_accumulation_steps(self.accumulation_steps)
        self._load_warmup_state(state)
        self.changes = [RampChange(**c) for c in state["changes"]]
        self._measured_at_change = len(self.noise_scale.history)
