"""Steps and warmup: DistributedSampler's epoch arithmetic, the warmup's length and the critical batch (no torch)."""

from __future__ import annotations

import math
from typing import Any

from ddplab.errors import UsageError
from ddplab.plan import scaling
from ddplab.plan.inputs import Data, Target
from ddplab.text import count

DEFAULT_WARMUP_EPOCHS = 5.0
"""Goyal et al.'s (2017) ImageNet warmup: 5 of 90 epochs."""
DEFAULT_WARMUP_SHARE = 0.1
"""The most of a run the default warmup takes: 5 epochs of a 3-epoch run would ramp the lr all run."""


def plan_steps(data: Data, target: Target, batch: int, accumulation: int, global_batch: int, lr_fields: dict[str, Any],
               warnings: list[str], *, reference_global_batch: int) -> dict[str, Any]:
    multiplier = lr_fields["lr_multiplier"]
    warmup = multiplier >= data.warmup_threshold
    out: dict[str, Any] = {"warmup_recommended": warmup}
    length = (count(data.warmup_steps, "step") if data.warmup_steps is not None else
              count(data.warmup_epochs, "epoch") if data.warmup_epochs is not None else
              "the reference's warmup samples" if data.reference_warmup_steps else
              f"{count(DEFAULT_WARMUP_EPOCHS, 'epoch')} or a tenth of the run, whichever is shorter")
    reasons = {"warmup_recommended": (
        f"the lr grows ×{multiplier:.4g} ≥ {{data.warmup_threshold}} {data.warmup_threshold:g}: ramp linearly from the "
        f"reference lr over {length} (Goyal et al. 2017)" if warmup else
        f"the lr multiplier {multiplier:.4g} is below {{data.warmup_threshold}} {data.warmup_threshold:g}: no warmup "
        "needed" + (" beyond the reference's own, kept in samples" if data.reference_warmup_steps else ""))}
    keys = ("samples_per_rank", "padded_samples", "dropped_samples", "loader_batches_per_rank",
            "steps_per_epoch", "total_steps", "samples_per_epoch")
    if data.dataset_size is None:
        out.update(dict.fromkeys(keys))
        reasons["steps_per_epoch"] = "pass {data.dataset_size} for step counts"
    else:
        out.update(_epoch_arithmetic(data, target, batch, accumulation, reasons))
        if out["samples_per_rank"] < batch * accumulation:
            # One epoch's share is less than one step's: every step is short, so the global batch is not what it says.
            seen = out["samples_per_rank"] * target.data_parallel_size
            share = f"{{target.per_device_batch_size}} {batch} × {count(accumulation, 'accumulation step')}"
            warnings.append(f"each {target.dims.rank} holds {out['samples_per_rank']} samples per epoch, fewer than "
                            f"one optimizer step's share ({share}): every step sees at most {seen} samples, not the "
                            f"global batch {global_batch}; lower {{target.per_device_batch_size}} or use more data")
    if data.reference_steps:
        out["total_steps"] = _same_samples(data.reference_steps, reference_global_batch, global_batch)
        reasons["total_steps"] = (f"{{data.reference_steps}} {data.reference_steps:,} steps of "
                                  f"{reference_global_batch} samples, the same samples in steps of {global_batch}")
    carried = (None if not data.reference_warmup_steps else
               _same_samples(data.reference_warmup_steps, reference_global_batch, global_batch))
    out.update(_warmup(data, warmup, out["steps_per_epoch"], out["total_steps"], lr_fields["lr"], reasons, warnings,
                       carried=carried, reference_global_batch=reference_global_batch))
    out.update(_critical(data, global_batch, reasons))
    return {**out, "reasons": reasons}


def _same_samples(steps: int, reference_global_batch: int, global_batch: int) -> int:
    """The steps of ``global_batch`` that see the samples of ``steps`` steps of the reference's batch."""
    return math.ceil(steps * reference_global_batch / global_batch)


def _warmup(data: Data, recommended: bool, steps_per_epoch: int | None, total: int | None, lr: float,
            reasons: dict[str, str], warnings: list[str], *, carried: int | None,
            reference_global_batch: int) -> dict[str, Any]:
    """The warmup length ``lr_lambda`` ramps over, in steps and epochs; never past the end of the run."""
    epochs = data.warmup_epochs if data.warmup_epochs is not None else DEFAULT_WARMUP_EPOCHS
    in_epochs = None
    if data.warmup_steps is not None:
        steps, why = int(data.warmup_steps), "given by {data.warmup_steps}"
    elif carried is not None and data.warmup_epochs is None:
        warmup = data.reference_warmup_steps
        steps, why = carried, (f"{{data.reference_warmup_steps}} {warmup:,} steps of {reference_global_batch} samples: "
                               f"the same {warmup * reference_global_batch:,} samples")
    elif not recommended:
        return {"warmup_steps": None, "warmup_epochs": None}
    elif steps_per_epoch is None:
        reasons["warmup_steps"] = (f"pass {{data.dataset_size}} (to count {count(epochs, 'warmup epoch')} in steps) "
                                   "or {data.warmup_steps}")
        warnings.append("warmup is recommended but its length in steps is unknown: pass {data.dataset_size} or "
                        "{data.warmup_steps}; until then the plan has no warmup schedule to give, and its lr must not "
                        "start at full strength")
        return {"warmup_steps": None, "warmup_epochs": epochs}
    else:
        steps = scaling.warmup_steps(warmup_epochs=epochs, steps_per_epoch=steps_per_epoch)
        why, in_epochs = f"{count(epochs, 'warmup epoch')} × {count(steps_per_epoch, 'step')} per epoch", epochs
        if data.warmup_epochs is None and total is not None and steps > DEFAULT_WARMUP_SHARE * total:
            (steps, why), in_epochs = _short_run_warmup(steps, why, total), None
    if total is not None and 0 < total <= steps:
        # A ramp that outlasts the run never reaches the planned lr: clamp it, and say so.
        warnings.append(f"a warmup of {steps:,} steps ({why}) does not end before the {total:,}-step run "
                        f"({count(data.epochs, 'epoch')}) does: clamped to {total:,} steps, so the lr climbs all run "
                        f"and never reaches {lr:.4g}; pass the run's real {{data.epochs}}, or a shorter "
                        "{data.warmup_epochs} or {data.warmup_steps}")
        why, steps, in_epochs = f"{why} = {steps:,}, clamped to the run's {total:,} steps", total, None
    reasons["warmup_steps"] = why
    if in_epochs is None and steps_per_epoch:
        in_epochs = steps / steps_per_epoch
    return {"warmup_steps": steps, "warmup_epochs": in_epochs}


def _short_run_warmup(steps: int, why: str, total: int) -> tuple[int, str]:
    """The default warmup of a run shorter than 50 epochs: a tenth of it, so the lr reaches its value early."""
    share = max(1, math.floor(DEFAULT_WARMUP_SHARE * total))
    return share, (f"a tenth of the {total:,}-step run ({why} = {steps:,} would take "
                   f"{steps / total:.0%} of it; set {{data.warmup_epochs}} or {{data.warmup_steps}} to choose)")


def _epoch_arithmetic(data: Data, target: Target, batch: int, accumulation: int,
                      reasons: dict[str, str]) -> dict[str, Any]:
    # DistributedSampler's num_replicas is the data-parallel degree: ranks that share samples share a shard.
    n, world = data.dataset_size, target.data_parallel_size
    if n < world:
        raise UsageError(f"{{data.dataset_size}} {n} is smaller than the {target.dims.ranks_noun} {world}: some ranks "
                         "would get no data")
    per_rank = scaling.samples_per_rank(n, world_size=world, drop_last=data.sampler_drop_last)
    padded = 0 if data.sampler_drop_last else scaling.padded_samples(n, world_size=world)
    dropped = scaling.sampler_dropped_samples(n, world_size=world) if data.sampler_drop_last else 0
    batches = scaling.loader_batches(per_rank, batch_size=batch, drop_last=data.drop_last)
    if batches == 0:
        raise UsageError(f"each rank gets {per_rank} samples, fewer than one batch of {batch} with {{data.drop_last}}: "
                         "lower {target.per_device_batch_size} or drop {data.drop_last}")
    loader_dropped = (per_rank - batches * batch) * world if data.drop_last else 0
    steps = scaling.optimizer_steps(loader_batches=batches, accumulation_steps=accumulation)
    total = math.ceil(steps * data.epochs)
    seen = (per_rank * world) - loader_dropped
    reasons.update({
        "samples_per_rank": (f"DistributedSampler drop_last=True gives floor({n}/{world})" if data.sampler_drop_last
                             else f"DistributedSampler gives each {target.dims.rank} ceil({n}/{world}), padding by "
                                  "repetition"),
        "padded_samples": "samples repeated so every rank gets the same count (0 with {data.sampler_drop_last})",
        "dropped_samples": "samples never seen in an epoch: the sampler's tail with {data.sampler_drop_last}, "
                           "each rank's last partial batch with {data.drop_last}",
        "loader_batches_per_rank": f"{per_rank} samples in batches of {batch}"
                                   + (", the last partial batch dropped" if data.drop_last
                                      else ", the last may be partial"),
        "steps_per_epoch": f"ceil({count(batches, 'loader batch', 'loader batches')} / "
                           f"{count(accumulation, 'accumulation step')})"
                           + ("; a final partial accumulation window still makes an optimizer step, as in Lightning "
                              "and the Hugging Face Trainer" if batches % accumulation else ""),
        "total_steps": f"{count(steps, 'step')} per epoch × {count(data.epochs, 'epoch')}",
        "samples_per_epoch": "samples the ranks process per epoch, repeats included",
    })
    return {"samples_per_rank": per_rank, "padded_samples": padded, "dropped_samples": dropped + loader_dropped,
            "loader_batches_per_rank": batches, "steps_per_epoch": steps, "total_steps": total,
            "samples_per_epoch": seen}


def _critical(data: Data, global_batch: int, reasons: dict[str, str]) -> dict[str, Any]:
    if data.critical_batch_size is None:
        return {"steps_factor": None, "compute_factor": None}
    crit = data.critical_batch_size
    reasons["steps_factor"] = f"1 + B_crit/B = 1 + {crit:g}/{global_batch}: steps relative to the fewest possible"
    reasons["compute_factor"] = f"1 + B/B_crit = 1 + {global_batch}/{crit:g}: samples relative to the fewest possible"
    return {"steps_factor": scaling.steps_factor(global_batch, crit),
            "compute_factor": scaling.compute_factor(global_batch, crit)}
