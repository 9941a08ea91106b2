"""Shared pieces for training a spec on DDP ranks: sharding, batching, seeding.

Rank ``r``'s batches come from ``DistributedSampler(num_replicas=W, rank=r)``; the same
indices, concatenated in rank order, give the single-process reference its global batches.
"""

from __future__ import annotations

import torch
from torch.utils.data import DistributedSampler, default_collate


def rank_indices(dataset_size: int, *, world_size: int, rank: int, seed: int, epoch: int) -> list[int]:
    """What DistributedSampler (shuffled, padded) yields to ``rank`` in ``epoch``."""
    sampler = DistributedSampler(range(dataset_size), num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def batch_indices(dataset_size: int, *, world_size: int, rank: int, per_device_batch_size: int, seed: int, step: int) -> list[int]:
    """The indices of ``rank``'s batch at global ``step``, walking through epochs as needed."""
    per_rank = len(DistributedSampler(range(dataset_size), num_replicas=world_size, rank=0))
    steps_per_epoch = per_rank // per_device_batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"each rank gets {per_rank} samples, fewer than --batch-size {per_device_batch_size}")
    epoch, within = divmod(step, steps_per_epoch)
    indices = rank_indices(dataset_size, world_size=world_size, rank=rank, seed=seed, epoch=epoch)
    return indices[within * per_device_batch_size:(within + 1) * per_device_batch_size]


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
