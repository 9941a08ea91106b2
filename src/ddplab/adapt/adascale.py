"""AdaScale on plain DDP (Johnson et al. 2020): any torch optimizer's lr scaled by the measured gain.

    gns = GradientNoiseScale(ddp_model, per_device_batch_size=32, every=1)
    adascale = AdaScale(optimizer, gns, reference_batch_size=32, scheduler=scheduler, reference_steps=10_000)
    while not adascale.done:
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(ddp_model(x), y).backward()
            gns.step()          # after backward, before the optimizer: the measurement
            optimizer.step()    # the adapter applies the gain during this update only
            if adascale.done:
                break

Each update runs at r_t × the reference schedule, r_t = (σ² + μ²)/(σ²/S + μ²) from the noise scale's
|G|² and tr Σ (smoothed as the paper does), S = global batch / reference batch. The reference
schedule advances in scale-invariant iterations: τ grows by r_t per step and the scheduler (stepped by
the adapter, never by your loop) steps each time τ passes a whole number, so a schedule written for the
reference run keeps its shape; training is done when τ reaches the reference run's length.

No DDP subclass and no collective beyond the noise scale's own: every rank reads the same reduced
estimates, so every rank applies the same gain. A step the optimizer does not take (GradScaler skipping
an overflow) neither moves τ nor the gain; a measured step whose norms are not finite is left out of the
averages. Gradient clipping: call ``gns.step()`` before clipping, so the gain sees the true gradients.
"""

from __future__ import annotations

import dataclasses

from ddplab.adapt.during_step import LrDuringStep, require_optimizer
from ddplab.adapt.gain import Smoothed, default_smoothing
from ddplab.errors import UsageError
from ddplab.validation import at_least, positive, within


@dataclasses.dataclass(frozen=True)
class AdaScaleStep:
    """One update the adapter scaled."""

    step: int
    gain: float
    tau: float
    """The scale-invariant iteration after this update."""
    lr: float
    """The lr of param group 0 during this update, the gain included."""


class AdaScale:
    """The AdaScale lr adapter over ``optimizer`` (and its ``scheduler``), fed by a ``GradientNoiseScale``.

    Args:
        optimizer: any ``torch.optim.Optimizer``, built with the reference run's lr.
        noise_scale: the ``ddplab.GradientNoiseScale`` on the DDP model this optimizer trains; measure
            every step (``every=1``) for a gain that follows training closely.
        reference_batch_size: the global batch the lr and the schedule were tuned for; the scale S is
            the noise scale's global batch over it (S ≥ 1).
        scheduler: a torch lr scheduler over ``optimizer``, stepped by the adapter as τ advances.
        reference_steps: the reference run's length in optimizer steps; ``done`` once τ reaches it.
        smoothing: the averaging factor θ of the σ² and μ² estimates (default max(1 − S/1000, 0)).
    """

    def __init__(self, optimizer, noise_scale, *, reference_batch_size: int, scheduler=None,
                 reference_steps: int | None = None, smoothing: float | None = None):
        _require_drivable(optimizer, noise_scale, scheduler)
        positive("reference_batch_size", reference_batch_size, integer=True)
        self.scale = noise_scale.b_big / reference_batch_size
        if self.scale < 1:
            raise UsageError(f"the global batch {noise_scale.b_big} is smaller than {{reference_batch_size}} "
                             f"{reference_batch_size}: AdaScale scales up from the reference, never down")
        at_least("reference_steps", reference_steps)
        if scheduler is not None and getattr(scheduler, "optimizer", optimizer) is not optimizer:
            raise UsageError("{scheduler} must schedule the {optimizer} AdaScale drives")
        smoothing = default_smoothing(self.scale) if smoothing is None else smoothing
        within("smoothing", smoothing, "[0, 1)")
        self.optimizer, self.noise_scale, self.scheduler = optimizer, noise_scale, scheduler
        self.reference_batch_size, self.reference_steps = reference_batch_size, reference_steps
        self.estimates = Smoothed(smoothing)
        self.tau, self.steps, self.scheduler_steps = 0.0, 0, 0
        self.history: list[AdaScaleStep] = []
        self._seen = len(noise_scale.history)
        self._gain = 1.0
        self._during_step = LrDuringStep(optimizer, self._next_gain, self._after)

    @property
    def gain(self) -> float:
        """The gain the next update will use."""
        self._absorb()
        return self.estimates.gain(self.scale)

    @property
    def done(self) -> bool:
        """τ has reached the reference run's length (never, without ``reference_steps``)."""
        return self.reference_steps is not None and self.tau >= self.reference_steps

    def _absorb(self) -> None:
        # The noise scale's new measured steps, each once: σ² of one reference-batch gradient and μ² = |G|².
        history = self.noise_scale.history
        for record in history[self._seen:]:
            self.estimates.update(record.trace_sigma / self.reference_batch_size, record.g2)
        self._seen = len(history)

    def _next_gain(self) -> float:
        self._gain = self.gain
        return self._gain

    def _after(self, lr: float) -> None:
        self.tau += self._gain
        self.steps += 1
        self.history.append(AdaScaleStep(self.steps - 1, self._gain, self.tau, lr))
        # The reference schedule runs on τ: one scheduler step per whole reference step covered.
        while self.scheduler is not None and self.tau >= self.scheduler_steps + 1:
            self.scheduler.step()
            self.scheduler_steps += 1

    def state_dict(self) -> dict:
        """What a checkpoint needs to resume the same τ, schedule position and gain estimates."""
        return {"tau": self.tau, "steps": self.steps, "scheduler_steps": self.scheduler_steps,
                "estimates": self.estimates.state_dict(), "scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict` (the scheduler's own state is restored by its ``load_state_dict``)."""
        if state["scale"] != self.scale:
            raise UsageError(f"the checkpoint's AdaScale ran at scale {state['scale']:g}, this one at "
                             f"{self.scale:g}: resume with the same global and reference batch")
        self.tau, self.steps, self.scheduler_steps = state["tau"], state["steps"], state["scheduler_steps"]
        self.estimates = Smoothed(**state["estimates"])
        self._seen = len(self.noise_scale.history)

    def remove(self) -> None:
        """Stop adapting: the optimizer's own lr from here on."""
        self._during_step.remove()


def _require_drivable(optimizer, noise_scale, scheduler) -> None:
    """What the adapter needs of each: torch's step hooks and param groups, the measured history, a step()."""
    require_optimizer(optimizer)
    if not (hasattr(noise_scale, "history") and hasattr(noise_scale, "b_big")):
        raise UsageError(f"{{noise_scale}} must be a ddplab GradientNoiseScale on the model {{optimizer}} trains, got "
                         f"{type(noise_scale).__name__}")
    if scheduler is not None and not callable(getattr(scheduler, "step", None)):
        raise UsageError(f"{{scheduler}} must be a torch lr scheduler (something with step()), got "
                         f"{type(scheduler).__name__}")
