"""Shared pieces for training a spec on DDP ranks: sharding, batching, seeding, validation.

Rank ``r``'s batches come from ``DistributedSampler(num_replicas=W, rank=r)``; the same
indices, concatenated in rank order, give the single-process reference its global batches.
A spec is validated once in the launching process (:func:`validate`) so its errors read as one
sentence before any rank starts; what still fails inside a rank comes back the same way
(:func:`rank_errors`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler, default_collate

from ddplab.launch import LaunchConfig, LaunchError, RankContext, launch, under_torchrun
from ddplab.spec import UNUSED_PARAMETERS_MARK, Spec, SpecError, describe, shown_path


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
    # Fewer samples than one batch would train on a smaller batch than the one reported.
    if per_rank < per_device_batch_size:
        raise ValueError(f"dataset() holds {dataset_size} samples, so each of {world_size} ranks gets {per_rank}, "
                         f"fewer than one batch of --batch-size {per_device_batch_size}: use --batch-size {per_rank} "
                         "or less, fewer ranks, or a larger dataset")
    return per_rank // per_device_batch_size if drop_last else -(-per_rank // per_device_batch_size)


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
        indices = rank_batch(dataset_size, world_size=world_size, rank=rank,
                             per_device_batch_size=per_device_batch_size,
                             seed=seed, step=step)
        # Rank r's j-th sample sits at position r + W·j of the padded permutation; past N it is a repeat.
        batch += [i for j, i in enumerate(indices, start=first) if keep_padding or rank + world_size * j < dataset_size]
    return batch


def collate(dataset, indices: list[int], device: torch.device, dtype: torch.dtype | None = None):
    """Stack dataset items into a batch on ``device``, floating tensors cast to ``dtype``."""
    items = [dataset[i] for i in indices]
    try:
        batch = default_collate(items)
    except (TypeError, RuntimeError) as exc:
        path = getattr(dataset, "spec_path", None)
        where = f"spec file {shown_path(path)}: " if path else ""
        raise SpecError(f"{where}dataset() items do not stack into a batch (torch's default_collate) "
                        f"{describe(exc)}") from exc
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


def world_size_for(requested: int | None, *, default: int) -> int:
    """The ranks to train on: torchrun's WORLD_SIZE under torchrun, else ``requested`` or ``default``."""
    if not under_torchrun():
        return default if requested is None else requested
    actual = int(os.environ["WORLD_SIZE"])
    if requested is not None and requested != actual:
        raise ValueError(f"--world-size {requested} disagrees with torchrun's WORLD_SIZE {actual}: under torchrun the "
                         "ranks are torchrun's, so drop --world-size or change --nproc_per_node")
    return actual


@dataclasses.dataclass(frozen=True)
class SpecFacts:
    """What one trial step of a spec found, which the ranks need to know before they start."""

    dataset_size: int
    unused_parameters: tuple[str, ...]
    """Trainable parameters that got no gradient on the trial batch."""
    find_unused_parameters: bool = False
    """Whether DDP must look for parameters without a gradient: some were unused on some batch."""


def validate(spec: Spec, *, world_size: int, per_device_batch_size: int, seed: int, drop_last: bool = False,
             dtype: torch.dtype | None = None) -> tuple[SpecFacts, Any]:
    """Build the spec's model and dataset and take one step's forward and backward, here, in one process.

    Whatever is wrong with the spec raises SpecError with one sentence, before any rank starts.
    Returns what the ranks need to know, and the dataset. The trial model is thrown away: no
    optimizer step is taken.
    """
    model = seeded_model(spec, seed, dtype=dtype)
    dataset = spec.dataset()
    try:
        steps_per_epoch(len(dataset), world_size=world_size, per_device_batch_size=per_device_batch_size,
                        drop_last=drop_last)
    except ValueError as exc:
        raise SpecError(f"spec file {spec.shown}: {exc}") from None
    # One rank's first batch: the same code path as the global one, at 1/W of the cost.
    indices = rank_batch(len(dataset), world_size=world_size, rank=0, per_device_batch_size=per_device_batch_size,
                         seed=seed, step=0)
    loss = spec.step(model, collate(dataset, indices, torch.device("cpu"), dtype), spec.loss)
    _check_loss(spec, loss)
    with spec.guard("backward through the loss"):
        loss.backward()
    unused = tuple(name for name, p in model.named_parameters() if p.requires_grad and p.grad is None)
    optimizer = spec.optimizer(model.parameters())
    if not (callable(getattr(optimizer, "step", None)) and callable(getattr(optimizer, "zero_grad", None))):
        raise SpecError(f"spec file {spec.shown}: optimizer(params) must return a torch.optim.Optimizer, "
                        f"got {type(optimizer).__name__}")
    return SpecFacts(dataset_size=len(dataset), unused_parameters=unused, find_unused_parameters=bool(unused)), dataset


def _check_loss(spec: Spec, loss) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise SpecError(f"spec file {spec.shown}: the loss must be a single-number tensor, got {got}")
    if not loss.requires_grad:
        raise SpecError(f"spec file {spec.shown}: the loss does not depend on any trainable parameter "
                        "(it does not require grad)")


def wrap_ddp(model: torch.nn.Module, ctx: RankContext, facts: SpecFacts):
    """``model`` in DistributedDataParallel, told to look for unused parameters only when there are some."""
    from torch.nn.parallel import DistributedDataParallel

    # Without find_unused_parameters DDP waits for a gradient that never comes and fails at the next step;
    # with it when every parameter is used, each rank prints a warning and pays a graph traversal per step.
    return DistributedDataParallel(model, device_ids=ctx.device_ids,
                                   find_unused_parameters=facts.find_unused_parameters)


def launch_spec(fn, launch_config: LaunchConfig, config, facts: SpecFacts) -> tuple[list, SpecFacts]:
    """``launch(fn, launch_config, config, facts)`` and the facts it ran with; spec errors come back as one sentence.

    A forward that leaves a parameter unused on a later batch only (the trial batch used them all)
    fails inside DDP; ranks we start ourselves are then started once more, looking for unused
    parameters. Under torchrun the ranks are not ours to restart: that failure is reported.
    """
    with rank_errors():
        try:
            return launch(fn, launch_config, config, facts), facts
        except LaunchError as exc:
            if facts.find_unused_parameters or UNUSED_PARAMETERS_MARK not in str(exc):
                raise
        facts = dataclasses.replace(facts, find_unused_parameters=True)
        return launch(fn, launch_config, config, facts), facts


@contextlib.contextmanager
def rank_errors() -> Iterator[None]:
    """A spec's error inside a rank comes back as a LaunchError holding its traceback: re-raise its one sentence."""
    try:
        yield
    except LaunchError as exc:
        prefix = f"{SpecError.__module__}.{SpecError.__qualname__}: "
        lines = [line[len(prefix):] for line in str(exc).splitlines() if line.startswith(prefix)]
        if not lines:
            raise
        where = f" (on rank {exc.rank})" if exc.rank is not None else ""
        raise SpecError(lines[-1] + where) from None
