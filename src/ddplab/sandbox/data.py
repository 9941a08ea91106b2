"""The sandbox's data: a counter-based generator, so sample i of experiment e is the same on every rank.

Each value is a pure function of (seed, experiment, epoch, sample): any subset of samples or
experiments, computed anywhere, gives the same numbers, so every rank holds the same dataset and
DistributedSampler shards it, as with real data.
"""

from __future__ import annotations

import math

import torch

from ddplab.sandbox.config import DATASET_SIZE, SandboxConfig

_MASK64 = (1 << 64) - 1


def _to_int64(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


_GOLDEN, _MIX1, _MIX2 = (_to_int64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    # int64 >> is arithmetic; mask off the sign copies to get splitmix64's logical shift.
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(state: torch.Tensor) -> torch.Tensor:
    """splitmix64's output for each state, on int64 tensors (multiplication wraps mod 2**64)."""
    z = state + _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def _uniform_pair(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Two 32-bit halves → two float64 in (0, 1); the half-step offset keeps log() finite.
    scale = 2.0 ** -32
    return ((_shift_right(bits, 32).double() + 0.5) * scale, ((bits & 0xFFFFFFFF).double() + 0.5) * scale)


def _stream_key(seed: int, epoch: int) -> int:
    """An int64 key for one (seed, epoch), mixed so nearby seeds share no counters."""
    return int(splitmix64(torch.tensor([_to_int64(seed * 0x100000001B3 + epoch)]))[0])


def noisy_samples(seed: int, epoch: int, indices: torch.Tensor,
                  experiments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x, y of shape (len(indices), len(experiments)) for these samples of these experiments.

    A pure function of (seed, experiment, epoch, sample index): any subset of samples or
    experiments, computed anywhere, gives the same numbers.
    """
    counter = (experiments.long()[None, :] * DATASET_SIZE + indices.long()[:, None]) * 2
    # The n-th splitmix64 state is key + n·γ: counters index one stream per (seed, epoch).
    state = _stream_key(seed, epoch) + counter * _GOLDEN
    u1, u2 = _uniform_pair(splitmix64(state))
    u3, u4 = _uniform_pair(splitmix64(state + _GOLDEN))
    # Box–Muller: one standard normal each for x and y.
    x = 1.0 + torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
    y = torch.sqrt(-2.0 * torch.log(u3)) * torch.cos(2.0 * math.pi * u4)
    return x.float(), y.float()


def batch(cfg: SandboxConfig, epoch: int, indices: list[int],
          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The toy data for these sample indices, shape (batch, n_experiments)."""
    shape = (len(indices), cfg.n_experiments)
    if cfg.deterministic:
        return torch.ones(shape, device=device), torch.zeros(shape, device=device)
    x, y = noisy_samples(cfg.seed, epoch, torch.tensor(indices), torch.arange(cfg.n_experiments))
    return x.to(device), y.to(device)


