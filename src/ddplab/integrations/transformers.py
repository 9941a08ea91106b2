"""The Transformers Trainer: a ``TrainerCallback`` for the gradient noise scale, and a plan for ``TrainingArguments``.

    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.add_callback(NoiseScaleCallback(trainer, every=4))   # logs b_simple, grad_sq_norm, trace_sigma
    trainer.train()

Needs ``pip install ddplab[transformers]``.
"""

from __future__ import annotations

import dataclasses

from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from ddplab.errors import UsageError
from ddplab.integrations import _noise
from ddplab.noise.scale import GradientNoiseScale
from ddplab.plan import planner


class NoiseScaleCallback(TrainerCallback):
    """Measure B_simple from DDP's all-reduce during ``trainer.train()``; log it every k optimizer steps.

    Needs ``max_grad_norm=0`` in the arguments while measuring: the Trainer clips the reduced gradient
    before any callback sees it, which would mix clipped and unclipped norms in the estimate.

    Args:
        trainer: the Trainer (its DDP wrapper exists only once training starts).
        every: measure every k-th optimizer step.
        log: pass ``b_simple``, ``grad_sq_norm``, ``trace_sigma`` to ``trainer.log`` on measured steps.
    """

    def __init__(self, trainer, *, every: int = 4, ema_decay: float = 0.95, log: bool = True):
        if every < 1:
            raise UsageError(f"every must be at least 1, got {every}")
        self.trainer, self.every, self.ema_decay, self.log = trainer, every, ema_decay, log
        self.noise_scale: GradientNoiseScale | None = None
        self.history: list[dict] = []

    def on_train_begin(self, args, state, control, **kwargs):
        if args.max_grad_norm:
            raise UsageError("NoiseScaleCallback needs max_grad_norm=0 in TrainingArguments: the Trainer clips "
                             "the gradient before callbacks see it")
        model = self.trainer.model_wrapped
        if args.world_size > 1 and not isinstance(model, DistributedDataParallel):
            raise UsageError(f"NoiseScaleCallback reads DDP's all-reduce; this Trainer wraps the model in "
                             f"{type(model).__name__}")
        self.noise_scale = GradientNoiseScale(
            model, per_device_batch_size=args.per_device_train_batch_size,
            accumulation_steps=args.gradient_accumulation_steps, every=self.every, ema_decay=self.ema_decay)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        values = _noise.measure(self.noise_scale, state.global_step, self.history)
        if values is not None and self.log:
            self.trainer.log(dict(values))


def plan(args, reference: planner.Reference, *, keep: str | None = "per-device", rule: str = "auto",
         data: planner.Data | None = None) -> planner.Plan:
    """Plan for ``args.world_size`` processes, its per-device batch and gradient accumulation."""
    target = planner.Target(devices=args.world_size, per_device_batch_size=args.per_device_train_batch_size,
                            accumulation_steps=args.gradient_accumulation_steps, keep=keep, rule=rule)
    return planner.plan(reference, target, data)


def apply_plan(args, plan: planner.Plan):
    """A copy of ``args`` with the plan's lr, batch, accumulation and (if recommended) warmup steps.

    The Trainer's linear warmup starts from 0 rather than from the reference lr (Goyal et al.); it is
    the gentler of the two.
    """
    changes = {"learning_rate": plan.lr, "per_device_train_batch_size": plan.per_device_batch_size,
               "gradient_accumulation_steps": plan.accumulation_steps}
    if plan.warmup_recommended and plan.warmup_steps:
        changes["warmup_steps"] = plan.warmup_steps
    return dataclasses.replace(args, **changes)
