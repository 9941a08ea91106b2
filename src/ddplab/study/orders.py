"""The orders in which a study's runs see their samples: each one DistributedSampler's, seed by seed.

- :class:`Batches`: global batch ``step`` of each seed, full batches per epoch (the grid's runs, on any engine);
- :class:`RankShards`: one DDP rank's share of the same batch (the DDP engine and the replay);
- :class:`Stream`: each seed's epochs back to back from a sample position (branches from a checkpoint, where every
  batch size must see the same samples).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ddplab.runtime.sharding import epoch_permutation, rank_indices

if TYPE_CHECKING:
    from ddplab.runtime.launch import RankContext


class Batches:
    """Global batch ``step`` of each seed: positions step·B … step·B+B−1 of the epoch's permutation.

    DistributedSampler gives rank r the positions r, r+W, r+2W, …; rank r's j-th loader batch of
    B/W samples, over all ranks, covers exactly those B positions. Full batches only, so padding never enters.
    """

    def __init__(self, dataset_size: int, global_batch: int, seeds: list[int]):
        self.size, self.global_batch, self.seeds = dataset_size, global_batch, seeds
        self.per_epoch = dataset_size // global_batch
        self._epoch, self._perms = -1, None

    def indices(self, step: int) -> torch.Tensor:
        """(len(seeds), B) sample indices for optimizer ``step`` (0-based)."""
        epoch, within = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            self._perms = torch.stack([epoch_permutation(self.size, seed=s, epoch=epoch) for s in self.seeds])
            self._epoch = epoch
        return self._perms[:, within * self.global_batch:(within + 1) * self.global_batch]


class RankShards:
    """This rank's part of global batch ``step``, in the engine's epochs (N // B full batches each)."""

    def __init__(self, dataset_size: int, global_batch: int, ctx: RankContext, seed: int):
        self.size, self.ctx, self.seed = dataset_size, ctx, seed
        self.per_device, self.per_epoch = global_batch // ctx.world_size, dataset_size // global_batch
        self._epoch, self._shard = -1, torch.empty(0, dtype=torch.long)

    def batch(self, step: int) -> torch.Tensor:
        epoch, within = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            self._shard = torch.tensor(rank_indices(self.size, world_size=self.ctx.world_size, rank=self.ctx.rank,
                                                    seed=self.seed, epoch=epoch))
            self._epoch = epoch
        return self._shard[within * self.per_device:(within + 1) * self.per_device]


class Stream:
    """Each seed's samples from position ``start`` on: its DistributedSampler epoch permutations back to back.

    Step k of a global batch B takes positions start + kB … start + kB + B − 1, so at one seed every batch size
    trains on the same samples in the same order, only grouped into steps differently.
    """

    def __init__(self, dataset_size: int, global_batch: int, seeds: list[int], start: int = 0):
        self.size, self.global_batch, self.seeds, self.start = dataset_size, global_batch, seeds, start
        self._epochs: dict[int, torch.Tensor] = {}

    def indices(self, step: int) -> torch.Tensor:
        """(len(seeds), B) sample indices of optimizer ``step`` (0-based)."""
        positions = torch.arange(self.start + step * self.global_batch, self.start + (step + 1) * self.global_batch)
        epochs = positions // self.size
        for epoch in list(self._epochs):
            if epoch < int(epochs[0]):
                del self._epochs[epoch]
        out = torch.empty(len(self.seeds), self.global_batch, dtype=torch.long)
        for epoch in epochs.unique().tolist():
            if epoch not in self._epochs:
                self._epochs[epoch] = torch.stack([epoch_permutation(self.size, seed=s, epoch=epoch)
                                                   for s in self.seeds])
            mask = epochs == epoch
            out[:, mask] = self._epochs[epoch][:, positions[mask] % self.size]
        return out
