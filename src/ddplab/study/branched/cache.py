"""The branches' cache: each branch's held-out losses under ``OUT/branches/``, one file per checkpoint and batch.

A file's name is the digest of everything a branch's losses depend on: the workload, the optimizer, the dtype,
the engine that trains it (vectorized, or ranks with their strategy), the budget, the global batch and the
checkpoint's own contents (model, optimizer state and samples seen). On the vectorized engine it also names the
group's runs: dropout draws one set of masks for the whole group, so a run's losses depend on its companions.
So a measurement that was stopped resumes where it was, another tolerance (``--branch-lag``) judges the same
branches without training them again, and no file can serve a branch it does not describe. ``--fresh`` clears it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import warnings

import torch

from ddplab.errors import UsageError, literal
from ddplab.serialize import write_json_atomic

Losses = dict[int, list[float]]
"""{steps: each run's held-out loss after them}, the runs in the order asked for."""


def checkpoint_digest(model: dict, optimizer: dict | None, samples_seen: int) -> str:
    """A digest of a checkpoint's contents: every tensor's bytes, dtype and shape, and every other value's repr."""
    digest = hashlib.sha256(str(samples_seen).encode())
    _feed(digest, model)
    _feed(digest, optimizer)
    return digest.hexdigest()


def _feed(digest, value) -> None:
    if torch.is_tensor(value):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        for key in sorted(value, key=repr):
            digest.update(repr(key).encode())
            _feed(digest, value[key])
    elif isinstance(value, list | tuple):
        for item in value:
            _feed(digest, item)
    else:
        digest.update(repr(value).encode())


class BranchCache:
    """Branch losses by (lr, seed), one JSON file per (setting, checkpoint, global batch), written atomically."""

    def __init__(self, directory: str, setting: dict, *, fresh: bool = False, by_group: bool = False):
        self.directory = os.path.join(directory, "branches")
        self.setting = json.dumps(setting, sort_keys=True, default=str)
        self.by_group = by_group
        try:
            if fresh and os.path.isdir(self.directory):
                shutil.rmtree(self.directory)
            os.makedirs(self.directory, exist_ok=True)
        except OSError as exc:
            # Said before any branch trains, not after the first batch is lost.
            raise UsageError(f"{{out}} cannot keep the branches' cache in {literal(self.directory)} "
                             f"({literal(exc.strerror or exc)}): choose another {{out}}") from None

    def _path(self, checkpoint: str, global_batch: int, runs: list[tuple[float, int]]) -> str:
        # Dropout gives each run of a vectorized group its masks by position: the group in its order.
        group = repr(list(runs)) if self.by_group else ""
        key = hashlib.sha256(f"{self.setting}|{checkpoint}|{global_batch}|{group}".encode()).hexdigest()[:24]
        return os.path.join(self.directory, f"batch-{global_batch}-{key}.json")

    def _runs(self, path: str) -> dict[str, dict[str, float]]:
        try:
            with open(path) as fh:
                runs = json.load(fh)["runs"]
        except (OSError, ValueError, KeyError, TypeError):
            # Missing, cut short or not ours: those branches train again.
            return {}
        return {key: clean for key, entry in runs.items() if (clean := _losses(entry)) is not None} \
            if isinstance(runs, dict) else {}

    def load(self, checkpoint: str, global_batch: int, runs: list[tuple[float, int]], steps: set[int]) -> Losses | None:
        """Every run's losses at ``steps``, or None unless the file holds them all."""
        cached = self._runs(self._path(checkpoint, global_batch, runs))
        found = [cached.get(_key(lr, seed), {}) for lr, seed in runs]
        if not all(str(step) in run for run in found for step in steps):
            return None
        return {step: [run[str(step)] for run in found] for step in sorted(steps)}

    def save(self, checkpoint: str, global_batch: int, runs: list[tuple[float, int]], losses: Losses) -> None:
        """Add ``runs``' losses to the batch's file; a file that cannot be written is said, and the measurement
        goes on without it."""
        path = self._path(checkpoint, global_batch, runs)
        cached = self._runs(path)
        for index, (lr, seed) in enumerate(runs):
            entry = cached.setdefault(_key(lr, seed), {})
            entry.update({str(step): values[index] for step, values in losses.items()})
        try:
            write_json_atomic(path, {"runs": cached}, standard=False)
        except OSError as exc:
            warnings.warn(f"the branches' cache file {path} cannot be written ({exc.strerror or exc}): a re-run "
                          "trains these branches again", stacklevel=2)


def _key(lr: float, seed: int) -> str:
    return f"{lr!r}|{seed}"


def _losses(entry) -> dict[str, float] | None:
    """A run's cached {step: loss}, or None when it is not one (an edited file)."""
    if not isinstance(entry, dict):
        return None
    try:
        values = {str(step): float(loss) for step, loss in entry.items()}
    except (TypeError, ValueError):
        return None
    # A diverged run's loss is kept as inf, as the branches report it.
    return {step: loss if math.isfinite(loss) else math.inf for step, loss in values.items()}
