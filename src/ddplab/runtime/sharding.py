"""Which samples each rank trains on at each step: DistributedSampler's order, computed once per epoch.

Rank ``r`` of ``W`` draws from ``DistributedSampler(num_replicas=W, rank=r, shuffle=True)``: a
permutation of the N samples under the sampler's seed + epoch, padded to a multiple of W by
repeating its start, then every W-th position from r. The same indices, concatenated in rank
order, give one process the global batch (:class:`ReferenceOrder`). The classes here compute
that order once per epoch and keep it as one int64 tensor, so a step costs the same on 4,000
samples as on 4,000,000 (the test suite pins them to DistributedSampler itself).
"""

from __future__ import annotations

import torch

from ddplab.errors import UsageError


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


def epoch_permutation(dataset_size: int, *, seed: int, epoch: int) -> torch.Tensor:
    """The permutation DistributedSampler shuffles ``epoch`` into, for the run with ``seed``."""
    generator = torch.Generator()
    generator.manual_seed(sampler_seed(seed) + epoch)
    return torch.randperm(dataset_size, generator=generator)


def padded(permutation: torch.Tensor, world_size: int) -> torch.Tensor:
    """The permutation padded as DistributedSampler pads it: its start repeated up to a multiple of W."""
    size = len(permutation)
    padding = -(-size // world_size) * world_size - size
    if padding == 0:
        return permutation
    repeats = -(-padding // size)
    return torch.cat([permutation, permutation.repeat(repeats)[:padding]])


def rank_indices(dataset_size: int, *, world_size: int, rank: int, seed: int, epoch: int) -> list[int]:
    """What DistributedSampler (shuffled, padded) yields to ``rank`` in ``epoch`` of the run with ``seed``."""
    order = padded(epoch_permutation(dataset_size, seed=seed, epoch=epoch), world_size)
    return order[rank::world_size].tolist()


def steps_per_epoch(dataset_size: int, *, world_size: int, per_device_batch_size: int, drop_last: bool) -> int:
    """Loader batches per rank in one epoch of DistributedSampler's shard."""
    if dataset_size < world_size:
        # Some ranks would train on the sampler's repeats alone.
        raise UsageError(f"dataset() holds {dataset_size} samples, fewer than the {world_size} ranks: use "
                         f"{{world_size}} {dataset_size} or less")
    per_rank = -(-dataset_size // world_size)
    # Fewer samples than one batch would train on a smaller batch than the one reported.
    if per_rank < per_device_batch_size:
        raise UsageError(f"dataset() holds {dataset_size} samples, so each of {world_size} ranks gets {per_rank}, "
                         f"fewer than one batch of {{per_device_batch_size}} {per_device_batch_size}: use "
                         f"{{per_device_batch_size}} {per_rank} or less, fewer ranks, or a larger dataset")
    return per_rank // per_device_batch_size if drop_last else -(-per_rank // per_device_batch_size)


class RankOrder:
    """One rank's loader batches through the epochs, as a DataLoader over DistributedSampler yields them.

    Holds the current epoch's shard (one int64 tensor of ceil(N/W) indices); a step in the next
    epoch replaces it. ``drop_last`` drops each epoch's last partial batch, as the DataLoader's does.
    """

    def __init__(self, dataset_size: int, *, world_size: int, rank: int, per_device_batch_size: int, seed: int,
                 drop_last: bool = False):
        self.dataset_size, self.world_size, self.rank, self.seed = dataset_size, world_size, rank, seed
        self.batch_size = per_device_batch_size
        self.per_epoch = steps_per_epoch(dataset_size, world_size=world_size,
                                         per_device_batch_size=per_device_batch_size, drop_last=drop_last)
        self._epoch, self._shard = -1, torch.empty(0, dtype=torch.long)

    def batch(self, step: int) -> list[int]:
        """Indices of this rank's batch at global ``step`` (0-based, counting loader batches)."""
        epoch, within = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            order = padded(epoch_permutation(self.dataset_size, seed=self.seed, epoch=epoch), self.world_size)
            # Only this rank's stride is kept: the full permutation is freed here.
            self._shard, self._epoch = order[self.rank::self.world_size].clone(), epoch
        return self._shard[within * self.batch_size:(within + 1) * self.batch_size].tolist()


class ReferenceOrder:
    """Every rank's batch at each step, from one padded permutation per epoch: one process's view of DDP."""

    def __init__(self, dataset_size: int, *, world_size: int, per_device_batch_size: int, seed: int):
        self.dataset_size, self.world_size, self.seed = dataset_size, world_size, seed
        self.batch_size = per_device_batch_size
        self.per_epoch = steps_per_epoch(dataset_size, world_size=world_size,
                                         per_device_batch_size=per_device_batch_size, drop_last=False)
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.long)

    def _epoch_order(self, step: int) -> tuple[torch.Tensor, int]:
        epoch, within = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            self._order = padded(epoch_permutation(self.dataset_size, seed=self.seed, epoch=epoch), self.world_size)
            self._epoch = epoch
        return self._order, within

    def rank_batch(self, step: int, rank: int, *, keep_padding: bool = True) -> list[int]:
        """What :class:`RankOrder` gives ``rank`` at ``step``; without the sampler's repeats unless ``keep_padding``."""
        order, within = self._epoch_order(step)
        # Rank r's j-th sample of the epoch sits at position r + W·j of the padded permutation: a strided view.
        first, last = within * self.batch_size, (within + 1) * self.batch_size
        if not keep_padding:
            # Positions past N are the sampler's repeats: rank r has ceil((N − r)/W) real ones.
            last = min(last, -(-(self.dataset_size - rank) // self.world_size))
        return order[rank::self.world_size][first:max(first, last)].tolist()

    def batch(self, step: int, *, keep_padding: bool = False) -> list[int]:
        """The ranks' batches at ``step`` concatenated in rank order: one process's global batch.

        DistributedSampler pads an epoch to a multiple of W by repeating samples; a single process
        would not see those repeats, so they are left out unless ``keep_padding``.
        """
        return [index for rank in range(self.world_size)
                for index in self.rank_batch(step, rank, keep_padding=keep_padding)]
