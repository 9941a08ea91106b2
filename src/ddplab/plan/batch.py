"""The target's batch: which mode holds what fixed, the per-device batch and accumulation, and why (no torch)."""

from __future__ import annotations

from typing import Any

from ddplab.errors import UsageError
from ddplab.plan import mesh, scaling
from ddplab.plan.inputs import Data, Keep, Reference, Target
from ddplab.text import count


def resolve_mode(reference: Reference, target: Target) -> Keep:
    if target.keep:
        if target.keep == "trajectory" and target.global_batch_size not in (None, reference.global_batch_size):
            raise UsageError(f"{{target.keep}} trajectory holds the reference's global batch of "
                             f"{reference.global_batch_size}; drop {{target.global_batch_size}} "
                             f"{target.global_batch_size} or use {{target.keep}} per-device")
        return target.keep
    if target.global_batch_size is not None:
        return "trajectory" if target.global_batch_size == reference.global_batch_size else "per-device"
    if target.per_device_batch_size is not None:
        accumulation = target.accumulation_steps or reference.accumulation_steps
        new_global = target.per_device_batch_size * target.data_parallel_size * accumulation
        return "trajectory" if new_global == reference.global_batch_size else "per-device"
    return "per-device"


def batch_for(mode: Keep, reference: Reference, target: Target) -> tuple[int, int]:
    """(per-device batch, accumulation steps) for the target."""
    wanted_global = reference.global_batch_size if mode == "trajectory" else target.global_batch_size
    if wanted_global is not None:
        return _split(wanted_global, target)
    batch = target.per_device_batch_size or _reference_device_batch(reference)
    accumulation = target.accumulation_steps or reference.accumulation_steps
    limit = target.max_batch_size_per_device
    if limit is None or batch <= limit:
        return batch, accumulation
    if target.accumulation_steps:
        raise UsageError(f"the reference's per-device batch of {batch} does not fit "
                         f"{{target.max_batch_size_per_device}} {limit}; give {{target.per_device_batch_size}} too, "
                         "or drop {target.accumulation_steps} to have it derived")
    # Same samples per rank per optimizer step, in micro-batches that fit: the global batch is unchanged.
    return scaling.split_global_batch(batch * accumulation * target.data_parallel_size,
                                      world_size=target.data_parallel_size, max_per_device=limit)


def _split(global_batch: int, target: Target) -> tuple[int, int]:
    world = target.data_parallel_size
    if target.per_device_batch_size:
        if global_batch % (target.per_device_batch_size * world):
            raise UsageError(f"{{target.per_device_batch_size}} {target.per_device_batch_size} on {target.dims.ranks} "
                             f"cannot "
                             f"reach a global batch of {global_batch}: it needs a multiple of "
                             f"{target.per_device_batch_size * world}")
        return target.per_device_batch_size, global_batch // (target.per_device_batch_size * world)
    if target.accumulation_steps:
        if global_batch % (target.accumulation_steps * world):
            raise UsageError(f"{{target.accumulation_steps}} {target.accumulation_steps} on {target.dims.ranks} cannot "
                             f"reach a global batch of {global_batch}: it needs a multiple of "
                             f"{target.accumulation_steps * world}")
        return global_batch // (target.accumulation_steps * world), target.accumulation_steps
    if global_batch % world and target.model_parallel_size > 1:
        options = " or ".join(map(str, scaling.nearest_divisible(global_batch, world)))
        raise UsageError(f"a data-parallel degree of {world} ({target.dims.division}) cannot split a global batch "
                         f"of {global_batch} evenly; use a global batch of {options}")
    return scaling.split_global_batch(global_batch, world_size=world, max_per_device=target.max_batch_size_per_device)


def _reference_device_batch(reference: Reference) -> int:
    per_device = reference.batch_per_device
    if per_device is None:
        raise UsageError("the reference gives only its global batch: give {target.per_device_batch_size} or "
                         "{target.global_batch_size} for the target")
    if per_device != int(per_device):
        raise UsageError(f"DataParallel splits the loader batch {reference.per_device_batch_size} unevenly over "
                         f"{reference.devices} devices; give {{target.per_device_batch_size}} for the target")
    return int(per_device)


def batch_reasons(reference: Reference, target: Target, mode: str, batch: int, accumulation: int,
                   global_batch: int, k: float) -> dict[str, str]:
    dp = target.data_parallel_size
    ranks = target.dims.ranks if target.model_parallel_size == 1 else f"data-parallel degree {dp}"
    reasons = {
        "reference_global_batch_size": _reference_formula(reference),
        "world_size": f"{count(target.devices, 'device')} × {count(target.nodes, 'node')}, "
                      f"one {target.notes.label} process per device",
        "global_batch_size": f"{batch} per device × {ranks} × {count(accumulation, 'accumulation step')}",
    }
    if target.model_parallel_size > 1 or target.notes.accumulation:
        reasons["data_parallel_size"] = _data_parallel_reason(target)
    if mode == "trajectory":
        reasons["per_device_batch_size"] = (
            f"keep trajectory: reach the reference's global batch of {reference.global_batch_size} exactly"
            + (f" within {{target.max_batch_size_per_device}} {target.max_batch_size_per_device}"
               if target.max_batch_size_per_device else ""))
        reasons["accumulation_steps"] = (f"the fewest accumulation steps that reach {global_batch} with "
                                         f"{batch} per device on {target.dims.ranks}")
    else:
        reasons.update(_per_device_reasons(reference, target, batch, accumulation, k))
    if accumulation > 1 and target.notes.accumulation:
        reasons["accumulation_steps"] += f"; {target.notes.accumulation}"
    return reasons


def _data_parallel_reason(target: Target) -> str:
    """Which ranks add samples, and what the strategy does over them."""
    dp = target.data_parallel_size
    if target.model_parallel_size == 1:
        why = f"data-parallel degree {dp} = {count(target.world_size, 'rank')}, each loading its own batch"
    else:
        roles = [role for size, role in ((target.tensor_parallel_size, "tp ranks split each layer"),
                                         (target.pipeline_parallel_size, "pp ranks hold successive stages"),
                                         (target.context_parallel_size, "cp ranks split each sequence")) if size > 1]
        why = (f"data-parallel degree {dp} = {target.dims.division}: {', '.join(roles)} of the same samples, "
               "adding none to the batch")
    why += f"; {target.notes.over_data_parallel}"
    replicate, shard = target.notes.split(dp, target.data_parallel_replicate_size)
    if target.notes.takes_replicate and replicate is None:
        return why + " (pass {target.data_parallel_replicate_size} to show the split)"
    if target.notes.takes_replicate:
        return (why + f": replicate {replicate} × shard {shard} (shard degree = {dp} ÷ "
                      f"{{target.data_parallel_replicate_size}} {replicate})")
    return why


def _per_device_reasons(reference: Reference, target: Target, batch: int, accumulation: int,
                        k: float) -> dict[str, str]:
    limit = target.max_batch_size_per_device
    within = f" with at most {limit} per device" if limit else ""
    grows = _growth(reference, target, accumulation, k)
    split = f"the fewest accumulation steps that reach {batch * accumulation} samples per rank{within}"
    if target.per_device_batch_size:
        batch_reason = "given by {target.per_device_batch_size}"
        accumulation_reason = split if target.global_batch_size else "kept from the reference"
    elif target.global_batch_size:
        batch_reason = f"{{target.global_batch_size}} {target.global_batch_size} over {target.dims.ranks}{within}"
        accumulation_reason = split
    elif batch != reference.batch_per_device:
        batch_reason = (f"keep per-device: the reference's {batch * accumulation} samples per rank per step, in "
                        f"micro-batches that fit {{target.max_batch_size_per_device}} {limit}; the global batch "
                        f"{grows}")
        accumulation_reason = split
    else:
        batch_reason = f"keep per-device: the reference's per-device batch, so the global batch {grows}"
        accumulation_reason = "kept from the reference"
    given = "given by {target.accumulation_steps}"
    return {"per_device_batch_size": batch_reason,
            "accumulation_steps": given if target.accumulation_steps else accumulation_reason}


def _growth(reference: Reference, target: Target, accumulation: int, k: float) -> str:
    """How the global batch changes at the reference's per-device batch: with the data-parallel degree."""
    if k == 1:
        return "stays the same"
    changes = [f"{name} {was} → {now}" for name, was, now in (
        ("data-parallel degree", reference.data_parallel_size, target.data_parallel_size),
        ("accumulation steps", reference.accumulation_steps, accumulation)) if was != now]
    meshed = max(reference.model_parallel_size, target.model_parallel_size) > 1
    if not changes or (not meshed and accumulation == reference.accumulation_steps):
        return f"grows ×{k:g} with the hardware"
    return f"grows ×{k:g}: {', '.join(changes)}" + (" (not the world size)" if meshed else "")


def _reference_formula(reference: Reference) -> str:
    if reference.per_device_batch_size is None:
        return "given by {reference.global_batch_size}"
    if reference.wrapper == "dp":
        return (f"DataParallel splits the loader batch of {reference.per_device_batch_size} across "
                f"{count(reference.devices, 'device')} and computes one loss on the gathered batch: global batch = "
                f"{reference.per_device_batch_size} × {count(reference.accumulation_steps, 'accumulation step')}")
    if reference.model_parallel_size > 1:
        return (f"{reference.per_device_batch_size} per device × data-parallel degree {reference.data_parallel_size} "
                f"({reference.dims.division}) × {count(reference.accumulation_steps, 'accumulation step')}")
    return (f"{reference.per_device_batch_size} per device × {count(reference.devices * reference.nodes, 'device')} × "
            f"{count(reference.accumulation_steps, 'accumulation step')}")


def mesh_fields(target: Target) -> dict[str, Any]:
    replicate, shard = target.notes.split(target.data_parallel_size, target.data_parallel_replicate_size)
    return {"world_size": target.world_size, "data_parallel_size": target.data_parallel_size,
            "tensor_parallel_size": target.tensor_parallel_size,
            "pipeline_parallel_size": target.pipeline_parallel_size,
            "context_parallel_size": target.context_parallel_size, "strategy": target.strategy,
            "data_parallel_replicate_size": replicate, "data_parallel_shard_size": shard}


def tokens_fields(reference: Reference, target: Target, data: Data, global_batch: int,
            reasons: dict[str, str]) -> dict[str, Any]:
    """Tokens per optimizer step, the target's and the reference's (None without a sequence length)."""
    out = {"reference_data_parallel_size": reference.data_parallel_size}
    if data.seq_len is None:
        return {**out, "tokens_per_step": None, "reference_tokens_per_step": None}
    tokens, was = (mesh.tokens_per_step(global_batch_size=batch, seq_len=data.seq_len)
                   for batch in (global_batch, reference.global_batch_size))
    reasons["tokens_per_step"] = (f"global batch {global_batch} × {{data.seq_len}} {data.seq_len}; the reference's: "
                                  f"{reference.global_batch_size} × {data.seq_len} = {was:,}"
                                  + (f"; each of the {target.context_parallel_size} context-parallel ranks holds "
                                     f"1/{target.context_parallel_size} of every sequence, adding none"
                                     if target.context_parallel_size > 1 else ""))
    return {**out, "tokens_per_step": tokens, "reference_tokens_per_step": was}
