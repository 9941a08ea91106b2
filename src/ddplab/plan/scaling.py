"""Pure formulas for data-parallel batch and learning-rate arithmetic (no torch).

>>> global_batch_size(per_device_batch_size=32, devices=8, nodes=2, accumulation_steps=2)
1024
>>> lr_multiplier(8, "linear"), lr_multiplier(4, "sqrt")
(8.0, 2.0)
>>> adam_betas(16, (0.9, 0.5)), adamw_weight_decay(0.01, batch_ratio=16, lr_ratio=4)
((0.9, 1.52587890625e-05), 0.04)
>>> samples_per_rank(1000, world_size=3, drop_last=False), padded_samples(1000, world_size=3)
(334, 2)
>>> optimizer_steps(loader_batches=10, accumulation_steps=4)
3
"""

from __future__ import annotations

import math
from typing import Literal, get_args

from ddplab.errors import UsageError
from ddplab.validation import at_least, one_of

Wrapper = Literal["single", "dp", "ddp"]
Rule = Literal["none", "linear", "sqrt"]
WRAPPERS: tuple[Wrapper, ...] = get_args(Wrapper)
RULES: tuple[Rule, ...] = get_args(Rule)


def global_batch_size(*, per_device_batch_size: int, devices: int = 1, nodes: int = 1,
                      accumulation_steps: int = 1, wrapper: Wrapper = "ddp") -> int:
    """Samples behind one optimizer step.

    DDP runs one process per device, each loading ``per_device_batch_size``. DataParallel runs
    one process whose loader batch it splits across devices, so ``per_device_batch_size`` is
    then the whole loader batch and the device count does not multiply it.
    """
    if wrapper == "dp" or wrapper == "single":
        return per_device_batch_size * nodes * accumulation_steps
    return per_device_batch_size * devices * nodes * accumulation_steps


def lr_multiplier(k: float, rule: Rule) -> float:
    """How much the learning rate grows when the global batch grows by ``k``."""
    if rule == "none":
        return 1.0
    if rule == "linear":
        return float(k)
    if rule == "sqrt":
        return math.sqrt(k)
    one_of("target.rule", rule, RULES)
    raise AssertionError(f"rule {rule!r} is in RULES but has no multiplier")


def adam_betas(k: float, betas: tuple[float, float]) -> tuple[float, float]:
    """Adam's betas when the global batch grows ×k: β₁ as given, β₂' = β₂^k.

    Marek et al. (2025, "Small batch size training for language models") find β₁ = 0.9 works at
    every batch size, and β₂ best kept at a constant half-life in samples: a step now averages k
    times the samples, so the moment decays by β₂^k per step. To first order that is Malladi et
    al.'s (2022) 1 − β₂' = k(1 − β₂), but β₂^k never leaves [0, 1), however far the batch grows.

    >>> adam_betas(2, (0.9, 0.99))
    (0.9, 0.9801)
    >>> adam_betas(16, (0.9, 0.5))
    (0.9, 1.52587890625e-05)
    """
    return betas[0], betas[1] ** k


def half_life_steps(beta: float) -> float:
    """Steps over which an exponential average with decay ``beta`` halves a sample's weight: ln ½ / ln β.

    >>> half_life_steps(0.5), half_life_steps(0.0)
    (1.0, 0.0)
    >>> round(half_life_steps(0.999), 1)
    692.8
    """
    return 0.0 if beta == 0 else math.log(0.5) / math.log(beta)


def adam_sqrt_eps(k: float, eps: float) -> float:
    """Adam's ε under the square-root rule (Malladi et al. 2022): ε' = ε/√k.

    >>> adam_sqrt_eps(4, 1e-8)
    5e-09
    """
    return eps / math.sqrt(k)


def adamw_weight_decay(weight_decay: float, *, batch_ratio: float, lr_ratio: float) -> float:
    """AdamW's decoupled weight decay at a constant timescale in epochs: λ' = λ·(B'/B)·(η/η').

    AdamW's weights are an exponential average of recent updates with a timescale of 1/(η·λ) steps,
    B/(η·λ·N) epochs; Wang & Aitchison (2024) and Bergsma et al. (2025, "Power Lines") find the best
    timescale constant in epochs. ``batch_ratio`` is B'/B and ``lr_ratio`` η'/η.

    >>> adamw_weight_decay(0.01, batch_ratio=16, lr_ratio=4)    # square-root rule: λ × √k
    0.04
    >>> adamw_weight_decay(0.01, batch_ratio=16, lr_ratio=16)   # linear rule: λ unchanged
    0.01
    """
    return weight_decay * (batch_ratio / lr_ratio)


def adamw_timescale_steps(*, lr: float, weight_decay: float) -> float:
    """AdamW's averaging timescale in optimizer steps, 1/(η·λ); infinite without decay.

    >>> adamw_timescale_steps(lr=0.001, weight_decay=0.5), adamw_timescale_steps(lr=0.001, weight_decay=0)
    (2000.0, inf)
    """
    return math.inf if weight_decay == 0 else 1.0 / (lr * weight_decay)


def adamw_timescale_epochs(*, lr: float, weight_decay: float, global_batch_size: int, dataset_size: int) -> float:
    """AdamW's averaging timescale in epochs, τ = B/(η·λ·N).

    >>> adamw_timescale_epochs(lr=0.001, weight_decay=0.5, global_batch_size=100, dataset_size=10000)
    20.0
    """
    return adamw_timescale_steps(lr=lr, weight_decay=weight_decay) * global_batch_size / dataset_size


SURGE_RANGE = 10.0
"""How far from B_noise (×, either way) the surge rule's lr is trusted before the plan warns."""


def surge_lr_factor(global_batch_size: float, noise_scale: float) -> float:
    """Li et al. (2024, "Surge phenomenon"): the best Adam lr at batch B over its peak, η*(B)/η_max.

    η*(B) = η_max / (½(√(B_noise/B) + √(B/B_noise))): it rises as √B below B_noise, peaks there and
    falls as 1/√B above it.

    >>> surge_lr_factor(1000, 1000), surge_lr_factor(250, 1000), surge_lr_factor(4000, 1000)
    (1.0, 0.8, 0.8)
    """
    return 1.0 / (0.5 * (math.sqrt(noise_scale / global_batch_size) + math.sqrt(global_batch_size / noise_scale)))


def surge_lr_multiplier(reference_batch_size: float, global_batch_size: float, noise_scale: float) -> float:
    """The surge rule's lr multiplier from the reference batch to ``global_batch_size``: η*(B')/η*(B).

    >>> surge_lr_multiplier(250, 4000, 1000)    # symmetric about B_noise: the same lr
    1.0
    >>> surge_lr_multiplier(250, 1000, 1000)    # from B_noise/4 up to the peak
    1.25
    """
    return surge_lr_factor(global_batch_size, noise_scale) / surge_lr_factor(reference_batch_size, noise_scale)


def outside_surge_range(global_batch_size: float, noise_scale: float) -> bool:
    """True when ``global_batch_size`` is more than :data:`SURGE_RANGE` times from B_noise, either way.

    >>> outside_surge_range(99, 1000), outside_surge_range(100, 1000), outside_surge_range(10001, 1000)
    (True, False, True)
    """
    return not noise_scale / SURGE_RANGE <= global_batch_size <= noise_scale * SURGE_RANGE


def samples_per_rank(dataset_size: int, *, world_size: int, drop_last: bool) -> int:
    """What DistributedSampler gives each rank: ceil(N/W) padded by repetition, or floor(N/W)."""
    return dataset_size // world_size if drop_last else -(-dataset_size // world_size)


def padded_samples(dataset_size: int, *, world_size: int) -> int:
    """Samples DistributedSampler repeats so every rank gets ceil(N/W) (no sampler drop_last)."""
    return samples_per_rank(dataset_size, world_size=world_size, drop_last=False) * world_size - dataset_size


def sampler_dropped_samples(dataset_size: int, *, world_size: int) -> int:
    """Samples DistributedSampler drops from the tail with drop_last=True."""
    return dataset_size - samples_per_rank(dataset_size, world_size=world_size, drop_last=True) * world_size


def loader_batches(samples: int, *, batch_size: int, drop_last: bool) -> int:
    """Batches a DataLoader yields from ``samples`` (the last one partial unless drop_last)."""
    return samples // batch_size if drop_last else -(-samples // batch_size)


def optimizer_steps(*, loader_batches: int, accumulation_steps: int) -> int:
    """Optimizer steps per epoch; a final partial accumulation window still steps."""
    return -(-loader_batches // accumulation_steps)


def warmup_steps(*, warmup_epochs: float, steps_per_epoch: int) -> int:
    return math.ceil(warmup_epochs * steps_per_epoch)


def warmup_factor(step: int, *, warmup_steps: int, lr_multiplier: float) -> float:
    """Factor on the scaled lr at ``step``: from the reference lr (1/multiplier) linearly to 1.

    Goyal et al. (2017) gradual warmup; usable as a LambdaLR ``lr_lambda``. An lr scaled down
    (multiplier ≤ 1) has nothing to warm up from: it starts at the planned lr.
    """
    if step < 0:
        raise ValueError(f"step must be ≥ 0 (LambdaLR counts from 0), got {step}")
    if warmup_steps <= 0 or step >= warmup_steps or lr_multiplier <= 1:
        return 1.0
    start = 1.0 / lr_multiplier
    return start + (1.0 - start) * step / warmup_steps


def nearest_divisible(global_batch: int, world_size: int) -> list[int]:
    """The nearest global batches below and above ``global_batch`` that W ranks split evenly."""
    below = global_batch // world_size * world_size
    return [b for b in (below, below + world_size) if b > 0]


def split_global_batch(global_batch: int, *, world_size: int, max_per_device: int | None = None) -> tuple[int, int]:
    """(per-device batch, accumulation steps) reaching ``global_batch`` exactly with the fewest accumulation steps.

    Raises UsageError when W does not divide the global batch, or no split fits ``max_per_device``.
    """
    if global_batch % world_size:
        options = " or ".join(map(str, nearest_divisible(global_batch, world_size)))
        raise UsageError(f"a world size of {world_size} cannot split a global batch of {global_batch} evenly; "
                         f"use a global batch of {options}")
    at_least("target.max_batch_size_per_device", max_per_device)
    per_rank = global_batch // world_size
    for accumulation in range(1, per_rank + 1):
        if per_rank % accumulation == 0 and (max_per_device is None or per_rank // accumulation <= max_per_device):
            return per_rank // accumulation, accumulation
    raise AssertionError("unreachable: one sample per device fits any limit of at least 1")


def steps_factor(global_batch: float, critical_batch: float) -> float:
    """Steps relative to the fewest possible (McCandlish et al. 2018): S/S_min = 1 + B_noise/B."""
    return 1.0 + critical_batch / global_batch


def compute_factor(global_batch: float, critical_batch: float) -> float:
    """Samples (compute) relative to the fewest possible: E/E_min = 1 + B/B_noise."""
    return 1.0 + global_batch / critical_batch
