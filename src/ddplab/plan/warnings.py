"""Warnings about what the numbers mean: a summed loss under data parallelism, a batch past the critical one, a
per-device batch too small to use a device."""

from __future__ import annotations

import math

from ddplab.plan import scaling
from ddplab.plan.inputs import Data, Keep, Reference, Target
from ddplab.text import count


def semantics_warnings(reference: Reference, target: Target, data: Data, *, mode: Keep, batch: int,
                       global_batch: int, total_steps: int | None) -> list[str]:
    """Every warning about the plan's meaning, in the order the table's rows raise them."""
    warnings = _reduction(reference, target)
    if mode == "trajectory":
        warnings += _small_device_batch(reference, target, batch, global_batch)
    if data.critical_batch_size and global_batch > 2 * data.critical_batch_size:
        warnings.append(_past_critical(target, data, global_batch, total_steps))
    return warnings


def _reduction(reference: Reference, target: Target) -> list[str]:
    warnings = []
    dp = target.data_parallel_size
    if reference.reduction == "sum" and dp > 1:
        # torchtitan's FSDP2 reduces over dp_shard_cp: context-parallel ranks join the average.
        with_cp = (f" (1/{dp * target.context_parallel_size} where the context-parallel ranks join the average, as in "
                   "torchtitan)" if target.context_parallel_size > 1 else "")
        warnings.append(f"reduction='sum': {target.notes.label} averages gradients over {target.dims.rank}s, so its "
                        f"gradient is 1/{dp} of the single-process sum{with_cp}; multiply the loss by the "
                        f"{target.dims.ranks_noun}, or use a mean-reduced loss")
    if reference.reduction == "sum" and reference.wrapper == "ddp" and reference.data_parallel_size > 1:
        warnings.append(f"the reference itself ran DDP with a summed loss: its gradients were already 1/"
                        f"{reference.data_parallel_size} of the sum")
    return warnings


def _small_device_batch(reference: Reference, target: Target, batch: int, global_batch: int) -> list[str]:
    """What keeping the global batch on more ranks costs: each device's share shrinks below what the reference used."""
    was, limit = reference.batch_per_device, target.max_batch_size_per_device
    if target.per_device_batch_size or was is None or batch >= was or (limit and batch >= limit):
        return []
    ranks = target.data_parallel_size / reference.data_parallel_size
    statistics = ("; BatchNorm's statistics come from that one sample per device (SyncBatchNorm pools them across "
                  "ranks)" if batch == 1 else "")
    return [f"keep trajectory holds the global batch {global_batch} on {target.dims.ranks}: "
            f"{count(batch, 'sample')} per device per micro-step, {was / batch:g}× fewer than the reference's "
            f"{was:g}; a batch that small leaves a device mostly idle, so a step takes about as long as the "
            f"reference's and the run gains little from ×{ranks:g} the data-parallel ranks{statistics}; "
            f"{{target.keep}} per-device keeps {was:g} per device"]


def _past_critical(target: Target, data: Data, global_batch: int, total_steps: int | None) -> str:
    """The batch is well past B_crit: say what it costs, and which batch the target can make near B_crit."""
    crit = data.critical_batch_size
    steps_factor, samples_factor = (scaling.steps_factor(global_batch, crit),
                                    scaling.compute_factor(global_batch, crit))
    text = (f"the global batch {global_batch} is well past the critical batch size {crit:g}: predicted "
            f"{steps_factor:.2f}× the minimum steps and {samples_factor:.2f}× the minimum compute; larger batches buy "
            "little speed")
    dp = target.data_parallel_size
    per_device = max(1, round(crit / dp))
    suggested = per_device * dp
    if suggested >= global_batch:
        return text
    fewer_steps, more_samples = scaling.steps_factor(suggested, crit), scaling.compute_factor(suggested, crit)
    text += (f"; a global batch of {suggested} ({per_device} per device × {target.dims.ranks}, no accumulation: "
             f"{{target.global_batch_size}} {suggested}) is the nearest the target makes to B_crit: predicted "
             f"{fewer_steps:.2f}× the minimum steps and {more_samples:.2f}× the minimum samples")
    if total_steps:
        # Same loss: S = S_min(1 + B_crit/B), E = E_min(1 + B/B_crit) (McCandlish et al. 2018).
        steps = math.ceil(total_steps * fewer_steps / steps_factor)
        text += (f", so the loss this plan reaches in {total_steps:,} steps of {global_batch} "
                 f"({total_steps * global_batch:,} samples) takes about {steps:,} steps of {suggested} "
                 f"({steps * suggested:,} samples)")
    return text
