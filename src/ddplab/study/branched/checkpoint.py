"""What the branches share: a checkpoint to branch from, the runs of each batch, what they trained, and the
held-out split they are scored on. No training code: the engines that train branches read these.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from ddplab.errors import UsageError
from ddplab.study.config import StudyConfig
from ddplab.study.workloads import Workload

Runs = list[tuple[float, int]]
"""(lr, seed) of each run of one global batch."""


Groups = dict[int, tuple[Runs, set[int]]]
"""{global batch: (its runs, the steps besides the last after which each run's held-out loss is kept)}."""


Trained = dict[int, dict[int, list[float]]]
"""{global batch: {steps: each run's held-out loss after them}}."""
Stop = Callable[[Trained], bool]
"""Whether the judgement is settled by the batches trained so far (no larger batch need train)."""
BranchTrainer = Callable[["Checkpoint", Groups, int, "Stop | None"], Trained]
"""Trains one checkpoint's branches: (checkpoint, groups, samples, stop) -> each run's held-out losses, the batches in
order and none after the first at which ``stop`` says the judgement is settled (an engine's, :mod:`ddplab.study.
engines.registry`)."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A state to branch from: the model's state_dict, torch.optim's state_dict (None: a fresh optimizer) and the
    samples the run had seen."""

    model: dict
    optimizer: dict | None
    samples_seen: int
    source: str
    """Where it came from: a file, or a step of the reference run."""
    notes: tuple[str, ...] = ()
    """What the user should know of it (a file without optimizer state, say)."""


def held_out(workload: Workload) -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out split every branch is scored on: the validation tensors (a spec's val_dataset() or dataset())."""
    if workload.val is not None:
        return workload.val
    from torch.utils.data import default_collate

    dataset = workload.eval_dataset
    try:
        inputs, targets = default_collate([dataset[i] for i in range(len(dataset))])
    except (TypeError, RuntimeError, IndexError, ValueError):
        raise UsageError("branches score the loss on val_dataset(): the spec's must hold (input, target) tensor "
                         "pairs") from None
    return inputs, targets


def notes(config: StudyConfig, checkpoint: Checkpoint) -> list[str]:
    """What the user should know of a checkpoint that loaded: a missing optimizer state, an lr unlike --ref-lr."""
    saved = checkpoint.optimizer
    where = checkpoint.source
    keeps_state = config.optimizer.adam or bool(config.optimizer.momentum)
    if saved is None or (keeps_state and not saved.get("state")):
        return [f"{where} has no optimizer state: its branches start with a fresh optimizer, as a restart would"]
    lrs = {group.get("lr") for group in saved.get("param_groups", [])}
    lr = next(iter(lrs)) if len(lrs) == 1 else None
    if isinstance(lr, int | float) and not math.isclose(lr, config.reference_lr, rel_tol=0.01):
        return [f"{where}'s optimizer ran at lr {lr:g}, and the branches scale from the reference lr "
                f"{config.reference_lr:g}: give the run's lr there as --ref-lr"]
    return []
