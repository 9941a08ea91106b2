"""Shared pieces for training a spec on DDP ranks: sharding, batching, seeding.

Rank ``r``'s batches come from ``DistributedSampler(num_replicas=W, rank=r)``; the same
indices, concatenated in rank order, give the single-process reference its global batches.
"""

from __future__ import annotations

import torch
from torch.utils.data import DistributedSampler, default_collate


def sampler_seed(seed: int) -> int:
    """The DistributedSampler seed for a run's ``seed``: splitmix64-mixed, below 2**62.

    The sampler shuffles epoch e with seed + e, so raw seeds 1 and 2 would share all but one
    epoch's order; mixed seeds lie far apart and give unrelated orders in every epoch.
    """
    mask = (1 << 64) - 1
    z = (seed + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    # Headroom below torch's 2**64 seed limit for the epochs added to it.
    return (z ^ (z >> 31)) >> 2


def rank_indices(dataset_size: int, *, world_size: int, rank: int, seed: int, epoch: int) -> list[int]:
    """What DistributedSampler (shuffled, padded) yields to ``rank`` in ``epoch`` of the run with ``seed``."""
    sampler = DistributedSampler(range(dataset_size), num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=sampler_seed(seed))
    sampler.set_epoch(epoch)
    return list(sampler)


def steps_per_epoch(dataset_size: int, *, world_size: int, per_device_batch_size: int, drop_last: bool) -> int:
    """Loader batches per rank in one epoch of DistributedSampler's shard."""
    per_rank = -(-dataset_size // world_size)
    steps = per_rank // per_device_batch_size if drop_last else -(-per_rank // per_device_batch_size)
    if steps == 0:
        raise ValueError(f"each rank gets {per_rank} samples, fewer than --batch-size {per_device_batch_size}")
    return steps


def rank_batch(dataset_size: int, *, world_size: int, rank: int, per_device_batch_size: int, seed: int, step: int,
               drop_last: bool = False) -> list[int]:
    """Indices of ``rank``'s batch at global ``step``, walking through epochs as a DataLoader would."""
    per_epoch = steps_per_epoch(dataset_size, world_size=world_size, per_device_batch_size=per_device_batch_size,
                                drop_last=drop_last)
    epoch, within = divmod(step, per_epoch)
    indices = rank_indices(dataset_size, world_size=world_size, rank=rank, seed=seed, epoch=epoch)
    return indices[within * per_device_batch_size:(within + 1) * per_device_batch_size]


def reference_batch(dataset_size: int, *, world_size: int, per_device_batch_size: int, seed: int, step: int,
                    keep_padding: bool = False) -> list[int]:
    """The ranks' batches at ``step`` concatenated in rank order: one process's global batch.

    DistributedSampler pads an epoch to a multiple of W by repeating samples; a single process
    would not see those repeats, so they are left out unless ``keep_padding``.
    """
    per_epoch = steps_per_epoch(dataset_size, world_size=world_size, per_device_batch_size=per_device_batch_size,
                                drop_last=False)
    first = step % per_epoch * per_device_batch_size
    batch = []
    for rank in range(world_size):
        indices = rank_batch(dataset_size, world_size=world_size, rank=rank, per_device_batch_size=per_device_batch_size,
                             seed=seed, step=step)
        # Rank r's j-th sample sits at position r + W·j of the padded permutation; past N it is a repeat.
        batch += [i for j, i in enumerate(indices, start=first) if keep_padding or rank + world_size * j < dataset_size]
    return batch


def collate(dataset, indices: list[int], device: torch.device, dtype: torch.dtype | None = None):
    """Stack dataset items into a batch on ``device``, floating tensors cast to ``dtype``."""
    batch = default_collate([dataset[i] for i in indices])
    return _move(batch, device, dtype)


def _move(value, device, dtype):
    if isinstance(value, torch.Tensor):
        value = value.to(device)
        return value.to(dtype) if dtype is not None and value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_move(v, device, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _move(v, device, dtype) for k, v in value.items()}
    return value


def seeded_model(spec, seed: int, dtype: torch.dtype | None = None, device: torch.device | None = None):
    """The spec's model, built under a fixed seed so every rank and the reference start equal."""
    torch.manual_seed(seed)
    model = spec.model()
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device) if device is not None else model
