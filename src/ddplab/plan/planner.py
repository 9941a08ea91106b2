"""Translate a reference training setup to new hardware, with a reason for every number (no torch).

>>> ref = Reference(per_device_batch_size=32, lr=0.1)
>>> p = plan(ref, Target(devices=8))
>>> p.mode, p.global_batch_size, p.lr, p.warmup_recommended
('per-device', 256, 0.8, True)
>>> plan(ref, Target(devices=8, keep="trajectory")).per_device_batch_size
4

Under a device mesh only the data-parallel ranks add samples: 16 ranks with tensor parallelism 2
are 8 data-parallel ranks, so the global batch is 32 × 8, not 32 × 16:

>>> p = plan(ref, Target(devices=8, nodes=2, tensor_parallel_size=2))
>>> p.data_parallel_size, p.global_batch_size, p.lr
(8, 256, 0.8)

Errors are :class:`~ddplab.errors.UsageError` sentences naming the field to change as the
argument holds it (``reference.lr``, ``target.devices``, ``data.dataset_size``), and so is the
plan's prose (its reasons, warnings and other mode): templates a Python caller reads with field
names and the command line with its flags (``plan(..., names=...)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ddplab.errors import UsageError, render
from ddplab.plan import mesh
from ddplab.plan.batch import batch_for, batch_reasons, mesh_fields, resolve_mode, tokens_fields
from ddplab.plan.inputs import Data, Keep, Reference, Target
from ddplab.plan.lr_rules import adamw_timescale, choose_rule, plan_lr, world_size_overshoot
from ddplab.plan.mesh import ParallelDims
from ddplab.plan.result import LrSource, MeasuredLr, Plan
from ddplab.plan.schedule import plan_steps
from ddplab.plan.warnings import semantics_warnings

__all__ = ["Data", "LrSource", "MeasuredLr", "ParallelDims", "Plan", "Reference", "Target", "in_words", "plan"]



def plan(reference: Reference, target: Target, data: Data | None = None, *, lr_source: LrSource | None = None,
         names: Mapping[str, str] | None = None) -> Plan:
    """Plan the target run; raises UsageError with a sentence naming what to change.

    ``lr_source`` replaces the lr rule with a measured lr at the planned global batch: the warmup,
    the Adam settings and the other mode are then all reasoned from that lr. The plan's prose (its
    reasons, warnings and other mode) names the fields to change as ``names`` shows them (by default
    as the arguments hold them: ``target.per_device_batch_size``; the command line passes its flags).
    """
    return in_words(_plan(reference, target, data or Data(), lr_source, describe_other=True), names)


def in_words(result: Plan, names: Mapping[str, str] | None) -> Plan:
    """``result`` with the fields its prose names shown as ``names`` says."""
    def say(text: str) -> str:
        return render(text, names)

    return dataclasses.replace(result, reasons={key: say(text) for key, text in result.reasons.items()},
                               warnings=tuple(map(say, result.warnings)), other_mode=say(result.other_mode))


def _plan(reference: Reference, target: Target, data: Data, lr_source: LrSource | None, *,
          describe_other: bool) -> Plan:
    mode = resolve_mode(reference, target)
    batch, accumulation = batch_for(mode, reference, target)
    reasons, warnings = {}, []
    global_batch = mesh.global_batch_size(per_device_batch_size=batch, data_parallel_size=target.data_parallel_size,
                                          accumulation_steps=accumulation)
    k = global_batch / reference.global_batch_size
    # Keep trajectory holds the reference's global batch and its lr: a measured lr would change the run it keeps.
    measured = lr_source(global_batch) if lr_source is not None and mode != "trajectory" else None
    rule = "measured" if measured else choose_rule(target.rule, reference.optimizer)
    lr_fields = plan_lr(reference, rule, k, warnings, measured, keep_settings=target.keep_optimizer_settings)
    if lr_source is not None and measured is None:
        lr_fields["reasons"]["lr"] += "; keep trajectory holds the reference's lr, so the measured lr is not used"
    reasons.update(batch_reasons(reference, target, mode, batch, accumulation, global_batch, k))
    reasons.update(lr_fields.pop("reasons"))
    if reference.model_parallel_size != target.model_parallel_size and rule in ("linear", "sqrt"):
        reasons["lr_multiplier"] += world_size_overshoot(reference, target, rule, k, lr_fields["lr_multiplier"])
    steps = plan_steps(data, target, batch, accumulation, global_batch, lr_fields, warnings,
                       reference_global_batch=reference.global_batch_size)
    reasons.update(steps.pop("reasons"))
    steps.update(adamw_timescale(reference, data, global_batch, lr_fields, reasons))
    warnings += semantics_warnings(reference, target, data, mode=mode, batch=batch, global_batch=global_batch,
                                   total_steps=steps["total_steps"])
    other = _other_mode(mode, reference, target, lr_source) if describe_other else ""
    return Plan(mode=mode, rule=rule, per_device_batch_size=batch, accumulation_steps=accumulation,
                global_batch_size=global_batch, reference_global_batch_size=reference.global_batch_size,
                batch_ratio=k, other_mode=other, warnings=tuple(warnings), reasons=reasons, **mesh_fields(target),
                **tokens_fields(reference, target, data, global_batch, reasons), **lr_fields, **steps)


def _other_mode(mode: Keep, reference: Reference, target: Target, lr_source: LrSource | None) -> str:
    other = "per-device" if mode == "trajectory" else "trajectory"
    try:
        alternative = _plan(reference, dataclasses.replace(
            target, keep=other, global_batch_size=None,
            per_device_batch_size=None if other == "trajectory" else target.per_device_batch_size), Data(),
            lr_source, describe_other=False)
    except UsageError as exc:
        return f"{{target.keep}} {other} is not possible here: {exc.template}"
    return (f"{{target.keep}} {other} would give {alternative.per_device_batch_size} per device × "
            f"{alternative.accumulation_steps} accumulation (global {alternative.global_batch_size}) "
            f"at lr {alternative.lr:.4g}")
