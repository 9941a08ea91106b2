"""Lightning callbacks: the gradient noise scale, lr scaling for the real world size, and the audit.

    trainer = L.Trainer(strategy="ddp", devices=2, callbacks=[
        GradientNoiseScale(every=4),                      # logs b_simple, grad_sq_norm, trace_sigma
        ScaleLearningRate(reference_lr=0.1, reference_global_batch_size=256),
        Audit(steps=5),
    ])

or, to grow the global batch with the measured noise scale (instead of ScaleLearningRate):
``noise = GradientNoiseScale(every=1)`` and ``callbacks=[noise, BatchRamp(noise, max_accumulation_steps=16)]``;
or to follow the batch schedule ``ddplab study --branch-at`` wrote: ``callbacks=[BatchSchedule("branched.json")]``.

Needs ``pip install ddplab[lightning]``. Lightning ignores ``DDPStrategy(ddp_comm_hook=...)`` on CPU;
the noise scale does not need a comm hook (it reads the local gradient from post-accumulate-grad hooks).
"""

from __future__ import annotations

import sys

import torch
from lightning.pytorch.callbacks import Callback
from torch.nn.parallel import DistributedDataParallel

from ddplab.errors import UsageError, literal
from ddplab.integrations import _lr, _noise
from ddplab.noise import scale as noise_scale
from ddplab.plan import planner


def _per_device_batch_size(trainer, given: int | None) -> int:
    if given is not None:
        return given
    loader = trainer.train_dataloader
    batch = getattr(loader, "batch_size", None)
    if not batch:
        raise UsageError("{per_device_batch_size} must be given: the training loader has no batch_size to read")
    return batch


class GradientNoiseScale(Callback):
    """Measure B_simple from DDP's own all-reduce; log ``b_simple``, ``grad_sq_norm``, ``trace_sigma`` every k steps.

    Args:
        every: measure every k-th optimizer step.
        per_device_batch_size: samples per process per micro-step (default: the training loader's batch_size).
        ema_decay: decay of the running averages behind ``b_simple``.
        log: log the three values with ``pl_module.log`` (rank 0's values; every rank computes the same).

    ``history`` holds one dict per measured step; ``noise_scale`` is the underlying
    :class:`ddplab.noise.scale.GradientNoiseScale` (``.summary()`` gives B_simple with a 95% interval).
    """

    def __init__(self, *, every: int = 4, per_device_batch_size: int | None = None, ema_decay: float = 0.95,
                 log: bool = True):
        if every < 1:
            raise UsageError(f"{{every}} must be at least 1, got {every}")
        self.every, self.per_device_batch_size, self.ema_decay, self.log = every, per_device_batch_size, ema_decay, log
        self.noise_scale: noise_scale.GradientNoiseScale | None = None
        self.history: list[dict] = []

    def on_train_start(self, trainer, pl_module) -> None:
        if self.noise_scale is not None:  # started already, by a BatchRamp that reads it
            return
        model = trainer.strategy.model
        if trainer.world_size > 1 and not isinstance(model, DistributedDataParallel):
            raise UsageError("GradientNoiseScale needs strategy='ddp' (or 'ddp_spawn') when training on several "
                             f"processes; this trainer wraps the model in {type(model).__name__}")
        self.noise_scale = noise_scale.GradientNoiseScale(
            model, per_device_batch_size=_per_device_batch_size(trainer, self.per_device_batch_size),
            accumulation_steps=trainer.accumulate_grad_batches, every=self.every, ema_decay=self.ema_decay)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # After the closure's backward (DDP has reduced), before the optimizer changes anything.
        values = _noise.measure(self.noise_scale, trainer.global_step, self.history)
        if values is not None and self.log:
            pl_module.log_dict(values, on_step=True, on_epoch=False, rank_zero_only=True)


class BatchRamp(Callback):
    """Grow the global batch with the measured noise scale: ``trainer.accumulate_grad_batches`` at each epoch's start.

    Args:
        noise_scale: the :class:`GradientNoiseScale` callback of the same trainer (measure every step or close).
        max_accumulation_steps: the most accumulation steps the ramp may reach.
        rule: how the lr follows the global batch: "auto" (linear for SGD, square root for Adam/AdamW),
            "linear", "sqrt" or "none"; applied during each optimizer step, so schedulers keep their own lr.
        warmup_steps: optimizer steps over which the lr moves to its new value after each jump.
        target_ratio: the global batch the ramp aims for, as a multiple of B_simple.
        interval: measured steps between two changes.

    Lightning counts accumulation windows from each epoch's first batch and divides each micro-batch's
    loss by ``accumulate_grad_batches``, so the ramp changes it only when an epoch starts, as Lightning's
    own ``GradientAccumulationScheduler`` does (an epoch whose batches do not divide by it ends in one
    shorter window). ``ramp`` is the underlying :class:`ddplab.adapt.ramp.BatchRamp`; ``ramp.changes``
    lists each growth.
    """

    def __init__(self, noise_scale: GradientNoiseScale, *, max_accumulation_steps: int, rule: str = "auto",
                 warmup_steps: int = 0, target_ratio: float = 1.0, interval: int = 10):
        if not isinstance(noise_scale, GradientNoiseScale):
            raise UsageError("{noise_scale} must be ddplab's Lightning GradientNoiseScale callback of the same "
                             f"trainer, got {type(noise_scale).__name__}")
        self.noise = noise_scale
        self.options = {"max_accumulation_steps": max_accumulation_steps, "rule": rule, "warmup_steps": warmup_steps,
                        "target_ratio": target_ratio, "interval": interval}
        self.ramp = None

    def on_train_start(self, trainer, pl_module) -> None:
        from ddplab.adapt.ramp import BatchRamp as Ramp

        self.noise.on_train_start(trainer, pl_module)
        optimizer = trainer.optimizers[0]
        options = dict(self.options)
        if options["rule"] == "auto":
            options["rule"] = "sqrt" if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) else "linear"
        self.ramp = Ramp(trainer.strategy.model, optimizer, self.noise.noise_scale, grow_after_step=False, **options)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self.ramp is not None and self.ramp.grow():
            trainer.accumulate_grad_batches = self.ramp.accumulation_steps

    def on_train_end(self, trainer, pl_module) -> None:
        if self.ramp is not None:
            self.ramp.remove()


class BatchSchedule(Callback):
    """Follow a batch schedule of samples seen: ``trainer.accumulate_grad_batches`` at each epoch's start.

    Args:
        schedule: what :class:`ddplab.adapt.schedule.BatchSchedule` reads: a list of ``{"samples_seen",
            "global_batch_size", "lr"}`` entries, a ``branched.json`` path, or a Megatron-style string.
        per_device_batch_size: samples per process per micro-step (default: the training loader's batch_size).
        warmup_steps: optimizer steps over which the lr moves to its new value after each change.

    Each update runs at the optimizer's own lr × the entry's lr over the first entry's (build the
    optimizer at the schedule's first lr), during the optimizer step only, so schedulers keep their own
    lr. As for :class:`BatchRamp`, the accumulation changes only when an epoch starts, to the entry the
    samples seen have reached by then: a threshold passed mid-epoch takes effect at the next epoch. The
    samples are counted as the global batch of each optimizer step (an epoch's shorter last window
    counts as a whole one). ``schedule`` is the underlying :class:`ddplab.adapt.schedule.BatchSchedule`;
    ``schedule.changes`` lists each change.
    """

    def __init__(self, schedule, *, per_device_batch_size: int | None = None, warmup_steps: int = 0):
        from ddplab.adapt import thresholds

        thresholds.parse(schedule)  # a bad schedule is refused when the callback is built, before the trainer runs
        self.entries, self.per_device_batch_size, self.warmup_steps = schedule, per_device_batch_size, warmup_steps
        self.schedule = None
        self._resumed: dict | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        from ddplab.adapt.schedule import BatchSchedule as Schedule

        self.schedule = Schedule(trainer.strategy.model, trainer.optimizers[0], self.entries,
                                 per_device_batch_size=_per_device_batch_size(trainer, self.per_device_batch_size),
                                 warmup_steps=self.warmup_steps, advance_after_step=False)
        if self._resumed is not None:
            self.schedule.load_state_dict(self._resumed)
        trainer.accumulate_grad_batches = self.schedule.accumulation_steps

    def state_dict(self) -> dict:
        """The schedule's state in Lightning's checkpoints (samples seen, batch, warmup)."""
        return self.schedule.state_dict() if self.schedule is not None else {}

    def load_state_dict(self, state_dict: dict) -> None:
        # Lightning restores callbacks before training starts: applied once the schedule exists.
        self._resumed = state_dict or None

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self.schedule is not None and self.schedule.advance():
            trainer.accumulate_grad_batches = self.schedule.accumulation_steps

    def on_train_end(self, trainer, pl_module) -> None:
        if self.schedule is not None:
            self.schedule.remove()


class ScaleLearningRate(Callback):
    """Apply a ddplab plan for the world size the trainer really has: scale the lr, add the Goyal warmup.

    Give the setup whose lr you trust (its lr and global batch). At the start of training the
    callback plans for ``trainer.world_size`` processes with the loader's per-device batch and
    ``accumulate_grad_batches``, then multiplies every optimizer's lr, its groups' ``initial_lr``
    and its schedulers' ``base_lrs`` by the plan's lr multiplier (scaling ``lr`` alone would be
    undone by the scheduler's next step), and, when the plan recommends it, warms up from the
    reference lr over the plan's warmup steps as a factor during each update only, so any scheduler
    keeps working.

    Args:
        reference_lr: the lr of the trusted setup.
        reference_global_batch_size: its global batch (per-device batch × processes × accumulation).
        rule: 'auto' (linear for SGD, square-root for Adam), 'linear', 'sqrt' or 'none'.
        optimizer: 'sgd', 'adam' or 'adamw', for the 'auto' rule.
        warmup_steps: warmup length in optimizer steps (default: none unless the plan recommends it; then
            the plan's length, which needs ``dataset_size``).
        dataset_size: samples in the training set, for the plan's warmup and step counts.
        per_device_batch_size: default: the training loader's batch_size.
    """

    def __init__(self, *, reference_lr: float, reference_global_batch_size: int, rule: str = "auto",
                 optimizer: str = "sgd", warmup_steps: int | None = None, dataset_size: int | None = None,
                 per_device_batch_size: int | None = None):
        self.reference = _reference(reference_lr, reference_global_batch_size, optimizer)
        self.rule, self.warmup_steps, self.dataset_size = rule, warmup_steps, dataset_size
        self.per_device_batch_size = per_device_batch_size
        self.plan: planner.Plan | None = None
        self.warmups: list[_lr.Warmup] = []

    def make_plan(self, *, world_size: int, per_device_batch_size: int, accumulation_steps: int) -> planner.Plan:
        target = planner.Target(devices=world_size, per_device_batch_size=per_device_batch_size,
                                accumulation_steps=accumulation_steps, keep="per-device", rule=self.rule)
        data = planner.Data(dataset_size=self.dataset_size, warmup_steps=self.warmup_steps)
        return planner.plan(self.reference, target, data)

    def on_train_start(self, trainer, pl_module) -> None:
        self.plan = self.make_plan(world_size=trainer.world_size,
                                   per_device_batch_size=_per_device_batch_size(trainer, self.per_device_batch_size),
                                   accumulation_steps=trainer.accumulate_grad_batches)
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        for optimizer in trainer.optimizers:
            _lr.scale_optimizer(optimizer, schedulers, self.plan.lr_multiplier)
            warmup = self.warmup_steps if self.warmup_steps is not None else (
                self.plan.warmup_steps if self.plan.warmup_recommended else None)
            if warmup is None and self.plan.warmup_recommended:
                self.plan.lr_lambda(0)  # raises: warmup recommended, its length unknown
            if warmup:
                self.warmups.append(_lr.Warmup(optimizer, warmup_steps=warmup,
                                               lr_multiplier=self.plan.lr_multiplier))

    def on_train_end(self, trainer, pl_module) -> None:
        for warmup in self.warmups:
            warmup.remove()


def _reference(lr: float, global_batch_size: int, optimizer: str) -> planner.Reference:
    """The trusted setup, known by its global batch; errors name this callback's own arguments."""
    try:
        return planner.Reference(global_batch_size=global_batch_size, lr=lr, optimizer=optimizer)
    except UsageError as exc:
        names = {"reference.global_batch_size": "reference_global_batch_size", "reference.lr": "reference_lr",
                 "reference.optimizer": "optimizer"}
        raise UsageError(literal(exc.render(names))) from None


class Audit(Callback):
    """Audit the DDP model for ``steps`` optimizer steps; rank 0 prints the merged report when training ends.

    The same auditor as ``ddplab audit -- python train.py``, started from the script instead of the
    command line (no collectives: each rank waits at most ``timeout`` seconds for its peers' records;
    by default 30 s times ``DDPLAB_TIME_SCALE``, :mod:`ddplab.runtime.timescale`).
    """

    def __init__(self, *, steps: int = 5, timeout: float | None = None):
        from ddplab.runtime import timescale

        if steps < 1:
            raise UsageError(f"{{steps}} must be at least 1, got {steps}")
        self.steps, self.timeout = steps, timescale.scaled(30.0) if timeout is None else timeout
        self.state = None
        self.report = None

    def on_train_start(self, trainer, pl_module) -> None:
        import ddplab

        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            raise UsageError(f"Audit needs strategy='ddp'; this trainer wraps the model in {type(model).__name__}")
        self.state = ddplab.audit(model, steps=self.steps)

    def on_train_end(self, trainer, pl_module) -> None:
        from ddplab.auditor import rendering

        if self.state is None:
            return
        # The report ends the audit: every patch is undone before the trainer goes on.
        self.report = self.state.report(timeout=self.timeout)
        if trainer.global_rank == 0:
            print(rendering.render_text(self.report), file=sys.stderr, flush=True)

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self.state is not None:
            self.state.close()
