"""Accelerate: the gradient noise scale of a prepared model, and a plan for the processes Accelerate really runs.

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    gns = noise_scale(accelerator, model, per_device_batch_size=32)
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model(x), y))
            if accelerator.sync_gradients:
                gns.step()          # after the synchronising backward, before the optimizer
            optimizer.step(); optimizer.zero_grad()

Needs ``pip install ddplab[accelerate]``.
"""

from __future__ import annotations

import os

from torch.nn.parallel import DistributedDataParallel

from ddplab.errors import UsageError
from ddplab.noise.scale import GradientNoiseScale
from ddplab.plan import planner


def _require_distributed(accelerator) -> None:
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if accelerator.num_processes == 1 and launched > 1:
        raise UsageError(f"the launcher started {launched} processes but Accelerate runs each alone "
                         f"(num_processes 1, {accelerator.distributed_type}): on a CPU machine use "
                         "Accelerator(cpu=True) or ACCELERATE_USE_CPU=1")


def noise_scale(accelerator, model, *, per_device_batch_size: int, every: int = 4,
                ema_decay: float = 0.95) -> GradientNoiseScale:
    """A :class:`ddplab.noise.scale.GradientNoiseScale` on the prepared (DDP-wrapped) model.

    Call its ``step()`` once per optimizer step, when ``accelerator.sync_gradients`` is true, after
    ``accelerator.backward`` and before ``optimizer.step()``. Accumulation is read from the accelerator
    (``accumulate()`` runs the other micro-steps under ``no_sync``).
    """
    _require_distributed(accelerator)
    if accelerator.num_processes > 1 and not isinstance(model, DistributedDataParallel):
        raise UsageError("pass the model returned by accelerator.prepare(): the noise scale reads DDP's all-reduce, "
                         f"and this model is a {type(model).__name__}")
    return GradientNoiseScale(model, per_device_batch_size=per_device_batch_size,
                                           accumulation_steps=accelerator.gradient_accumulation_steps,
                                           every=every, ema_decay=ema_decay)


def plan(accelerator, reference: planner.Reference, *, per_device_batch_size: int | None = None,
         global_batch_size: int | None = None, keep: str | None = "per-device", rule: str = "auto",
         data: planner.Data | None = None) -> planner.Plan:
    """Plan for ``accelerator.num_processes`` processes and its ``gradient_accumulation_steps``.

    With ``keep='per-device'`` (the default) the per-device batch is held and the lr scaled for the
    larger global batch; ``keep='trajectory'`` with ``global_batch_size`` holds the reference's batch and lr.
    Note that a scheduler prepared by Accelerate steps ``num_processes`` times per optimizer step: give
    the plan's warmup and total steps to it multiplied by ``num_processes`` (see SCHEDULER_STEPS_PER_PROCESS).
    """
    _require_distributed(accelerator)
    accumulation = accelerator.gradient_accumulation_steps if global_batch_size is None else None
    target = planner.Target(devices=accelerator.num_processes, per_device_batch_size=per_device_batch_size,
                            global_batch_size=global_batch_size, accumulation_steps=accumulation, keep=keep,
                            rule=rule)
    return planner.plan(reference, target, data)


def apply_plan(plan: planner.Plan, optimizer, schedulers=(), *, reference_lr: float | None = None):
    """Scale ``optimizer`` (built with the reference lr) for the plan: its lr, ``initial_lr`` and the schedulers'
    ``base_lrs`` by the plan's multiplier, plus the plan's Goyal warmup when it recommends one.

    Call it after building the scheduler and before ``accelerator.prepare`` (a prepared optimizer or
    scheduler wraps the real one: pass ``.optimizer`` / ``.scheduler``). ``reference_lr`` checks that the
    optimizer really starts from the plan's reference. Returns the warmup (or None): its ``applied``
    lists the lr of each update.
    """
    from ddplab.integrations import _lr

    optimizer = getattr(optimizer, "optimizer", optimizer)
    schedulers = [getattr(s, "scheduler", s) for s in schedulers]
    if reference_lr is not None and not all(g["lr"] == reference_lr for g in optimizer.param_groups):
        raise UsageError(f"the optimizer's lr is not the reference lr {reference_lr}: apply the plan once, to an "
                         "optimizer built with the reference lr")
    _lr.scale_optimizer(optimizer, schedulers, plan.lr_multiplier)
    if plan.warmup_recommended:
        plan.lr_lambda(0)  # raises when the warmup's length is unknown
        return _lr.Warmup(optimizer, warmup_steps=plan.warmup_steps, lr_multiplier=plan.lr_multiplier)
    return None
