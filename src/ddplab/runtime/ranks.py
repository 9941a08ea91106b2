"""Training a spec on data-parallel ranks: the checks before any rank starts, the model, the batches.

The wrapper is the strategy's (:mod:`ddplab.runtime.strategies`), given the :class:`SpecFacts` found here.

A spec is validated once in the launching process (:func:`validate`) so its errors read as one
sentence before any rank starts; what still fails inside a rank comes back the same way
(:func:`rank_errors`), from the rank's structured failure record.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import default_collate

from ddplab.errors import LaunchError, SpecError, literal
from ddplab.runtime import capacity
from ddplab.runtime.deadline import Deadline
from ddplab.runtime.launch import LaunchConfig, gpus_for, launch, under_torchrun
from ddplab.runtime.sharding import RankOrder, steps_per_epoch
from ddplab.runtime.spec import Spec, describe, shown_path


def collate(dataset, indices: list[int], device: torch.device, dtype: torch.dtype | None = None,
            collate_fn=None):
    """Stack dataset items into a batch on ``device``, floating tensors cast to ``dtype``.

    ``collate_fn`` is the spec's own ``collate(items)`` (padding variable-length items, say); torch's
    ``default_collate`` otherwise.
    """
    items = [dataset[i] for i in indices]
    if collate_fn is not None:
        return move(collate_fn(items), device, dtype)
    try:
        batch = default_collate(items)
    except (TypeError, RuntimeError) as exc:
        path = getattr(dataset, "spec_path", None)
        where = f"spec file {literal(shown_path(path))}: " if path else ""
        raise SpecError(f"{where}dataset() items do not stack into a batch (torch's default_collate) "
                        f"{literal(describe(exc))}") from exc
    return move(batch, device, dtype)


def move(value, device, dtype=None):
    """Tensors in a (nested) batch on ``device``, floating ones cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        value = value.to(device)
        return value.to(dtype) if dtype is not None and value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(move(v, device, dtype) for v in value)
    if isinstance(value, dict):
        return {k: move(v, device, dtype) for k, v in value.items()}
    return value


def seeded_model(spec, seed: int, dtype: torch.dtype | None = None, device: torch.device | None = None):
    """The spec's model, built under a fixed seed so every rank and the reference start equal."""
    torch.manual_seed(seed)
    model = spec.model()
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device) if device is not None else model


@dataclasses.dataclass(frozen=True)
class SpecFacts:
    """What one trial step of a spec found, which the ranks need to know before they start."""

    dataset_size: int
    rank_bytes: int
    """Memory the trial step took in this process (model, dataset, one step): what each rank will need too."""
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
    before = capacity.resident_bytes()
    model = seeded_model(spec, seed, dtype=dtype)
    dataset = spec.dataset()
    with spec.guard("the dataset's size"):
        steps_per_epoch(len(dataset), world_size=world_size, per_device_batch_size=per_device_batch_size,
                        drop_last=drop_last)
    # One rank's first batch: the same code path as the global one, at 1/W of the cost.
    indices = RankOrder(len(dataset), world_size=world_size, rank=0, per_device_batch_size=per_device_batch_size,
                        seed=seed).batch(0)
    loss = spec.step(model, collate(dataset, indices, torch.device("cpu"), dtype, spec.collate), spec.loss)
    _check_loss(spec, loss)
    with spec.guard("backward through the loss"):
        loss.backward()
    unused = tuple(name for name, p in model.named_parameters() if p.requires_grad and p.grad is None)
    optimizer = spec.optimizer(model.parameters())
    if not (callable(getattr(optimizer, "step", None)) and callable(getattr(optimizer, "zero_grad", None))):
        raise spec.error(f"optimizer(params) must return a torch.optim.Optimizer, got {type(optimizer).__name__}")
    after = capacity.resident_bytes()
    rank_bytes = max(after - before, 0) if before is not None and after is not None else 0
    return SpecFacts(dataset_size=len(dataset), rank_bytes=rank_bytes, unused_parameters=unused,
                     find_unused_parameters=bool(unused)), dataset


def check_capacity(world_size: int, facts: SpecFacts) -> None:
    """Before starting ranks ourselves: refuse ranks that cannot fit in memory, warn when they share cores."""
    if not under_torchrun():
        capacity.check_ranks(world_size, facts.rank_bytes, on_cpu=not gpus_for(world_size))


def _check_loss(spec: Spec, loss) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise spec.error(f"the loss must be a single-number tensor, got {got}")
    if not loss.requires_grad:
        raise spec.error("the loss does not depend on any trainable parameter (it does not require grad)")


def launch_spec(fn, launch_config: LaunchConfig, config, facts: SpecFacts,
                deadline: Deadline | None = None) -> tuple[list, SpecFacts]:
    """``launch(fn, launch_config, config, facts)`` and the facts it ran with; spec errors come back as one sentence.

    A forward that leaves a parameter unused on a later batch only (the trial batch used them all)
    fails inside DDP; ranks we start ourselves are then started once more, looking for unused
    parameters, within what is left of ``deadline``. Under torchrun the ranks are not ours to
    restart: that failure is reported.
    """
    deadline = deadline or Deadline(None)
    with rank_errors():
        try:
            return launch(fn, deadline.for_launch(launch_config), config, facts), facts
        except LaunchError as exc:
            if facts.find_unused_parameters or exc.failure is None or not exc.failure.unused_parameters:
                raise
        facts = dataclasses.replace(facts, find_unused_parameters=True)
        return launch(fn, deadline.for_launch(launch_config), config, facts), facts


@contextlib.contextmanager
def rank_errors() -> Iterator[None]:
    """Bad input found inside a rank (a spec's error) comes back as that one sentence, naming the rank."""
    try:
        yield
    except LaunchError as exc:
        usage = exc.failure.usage_error() if exc.failure is not None else None
        if usage is None:
            raise
        raise usage from None
