"""Data order: each rank's batches are DistributedSampler's, bit for bit, and a step costs the same on any N."""

import pytest
import torch
from torch.utils.data import DistributedSampler

from ddplab.errors import UsageError
from ddplab.runtime.sharding import RankOrder, ReferenceOrder, rank_indices, sampler_seed, steps_per_epoch


def _sampler_batch(dataset_size, *, world_size, rank, per_device_batch_size, seed, step, drop_last=False):
    """The definition the cached orders must match: a fresh DistributedSampler per step, as before them."""
    per_epoch = steps_per_epoch(dataset_size, world_size=world_size, per_device_batch_size=per_device_batch_size,
                                drop_last=drop_last)
    epoch, within = divmod(step, per_epoch)
    sampler = DistributedSampler(range(dataset_size), num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=sampler_seed(seed))
    sampler.set_epoch(epoch)
    return list(sampler)[within * per_device_batch_size:(within + 1) * per_device_batch_size]


@pytest.mark.parametrize("dataset_size, world_size, batch", [(100, 3, 7), (64, 4, 16), (1001, 3, 167), (10, 4, 2),
                                                             (5, 3, 1), (7, 7, 1)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_rank_orders_are_distributed_samplers_own(dataset_size, world_size, batch, drop_last):
    for seed in (0, 5):
        orders = [RankOrder(dataset_size, world_size=world_size, rank=r, per_device_batch_size=batch, seed=seed,
                            drop_last=drop_last) for r in range(world_size)]
        for step in range(3 * orders[0].per_epoch + 1):  # across epoch boundaries, partial batches included
            for rank, order in enumerate(orders):
                assert order.batch(step) == _sampler_batch(dataset_size, world_size=world_size, rank=rank, seed=seed,
                                                           per_device_batch_size=batch, step=step, drop_last=drop_last)


def test_the_reference_is_the_ranks_batches_in_rank_order_without_the_padding():
    size, world, batch = 1001, 3, 167
    reference = ReferenceOrder(size, world_size=world, per_device_batch_size=batch, seed=2)
    for step in range(5):
        ranks = [_sampler_batch(size, world_size=world, rank=r, per_device_batch_size=batch, seed=2, step=step)
                 for r in range(world)]
        assert reference.batch(step, keep_padding=True) == [i for r in ranks for i in r]
        assert [reference.rank_batch(step, r) for r in range(world)] == ranks
    # 1001 samples on 3 ranks: 334 each, one repeat, in the epoch's last batch; the reference leaves it out.
    last = reference.batch(1)
    assert len(last) == 3 * 167 - 1 and len(set(last)) == len(last)
    assert sorted(reference.batch(0) + last) == list(range(size))


def test_sampler_seeds_give_unrelated_orders_in_every_epoch():
    orders = {seed: [rank_indices(64, world_size=1, rank=0, seed=seed, epoch=e) for e in range(4)]
              for seed in (1, 2)}
    # DistributedSampler alone shuffles epoch e with seed + e: seed 2's epoch 0 would be seed 1's epoch 1.
    assert not any(a == b for a in orders[1] for b in orders[2])
    assert rank_indices(64, world_size=1, rank=0, seed=1, epoch=0) == orders[1][0]


def test_the_order_is_computed_once_per_epoch_and_keeps_one_shard(monkeypatch):
    from ddplab.runtime import sharding

    calls = []
    real = sharding.epoch_permutation
    monkeypatch.setattr(sharding, "epoch_permutation", lambda *a, **k: calls.append(k["epoch"]) or real(*a, **k))
    order = RankOrder(400_000, world_size=2, rank=1, per_device_batch_size=8, seed=0)
    for step in range(2 * order.per_epoch + 3):
        order.batch(step)
    # Three epochs touched, three permutations: none per step (each cost ~21 ms at this size).
    assert calls == [0, 1, 2]
    # One int64 index tensor of ceil(N/W) for the current epoch, not the full permutation.
    assert order._shard.dtype == torch.int64 and order._shard.numel() == 200_000 and order._shard.is_contiguous()
    reference = ReferenceOrder(400_000, world_size=2, per_device_batch_size=8, seed=0)
    calls.clear()
    for step in range(3):
        reference.batch(step)
        reference.rank_batch(step, 1)
    assert calls == [0]


def test_fewer_samples_than_one_batch_per_rank_is_refused_with_the_sizes():
    with pytest.raises(UsageError, match="each of 2 ranks gets 5, fewer than one batch of per_device_batch_size 8"):
        steps_per_epoch(10, world_size=2, per_device_batch_size=8, drop_last=False)
    # More ranks than samples: some would train on the sampler's repeats alone.
    with pytest.raises(UsageError, match="512 samples, fewer than the 2000 ranks: use world_size 512 or less"):
        steps_per_epoch(512, world_size=2000, per_device_batch_size=1, drop_last=False)
