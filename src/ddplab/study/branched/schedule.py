"""The batch schedule the critical batches imply: double the batch where the critical batch reaches twice it,
and the same schedule as Megatron-LM's ``--step-batch-size-schedule`` (pure).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

ScheduleStep = dict
"""{"samples_seen": n, "global_batch_size": B, "lr": lr}: from n samples on, train at B with lr."""


def schedule(checkpoints: Sequence[tuple[int, int | None, Mapping[int, float]]], reference_global_batch: int,
             reference_lr: float) -> list[ScheduleStep]:
    """Merrill et al.'s batch size warmup from measured critical batches: start at the reference batch and, at each
    checkpoint (samples seen, critical batch, {batch: its best lr there}) in order, double the batch as many times
    as the critical batch is at least twice it (so it never passes the critical batch). The lr of a step is the
    best the branches found at that batch there.

    >>> steps = schedule([(0, 8, {}), (1000, 16, {16: 0.2}), (3000, 64, {32: 0.3, 64: 0.5})], 8, 0.1)
    >>> [(s["samples_seen"], s["global_batch_size"], s["lr"]) for s in steps]
    [(0, 8, 0.1), (1000, 16, 0.2), (3000, 64, 0.5)]
    """
    steps = [{"samples_seen": 0, "global_batch_size": reference_global_batch, "lr": reference_lr}]
    for samples_seen, critical, best_lrs in sorted(checkpoints, key=lambda c: c[0]):
        batch = steps[-1]["global_batch_size"]
        while critical is not None and critical >= 2 * batch:
            batch *= 2
        if batch != steps[-1]["global_batch_size"]:
            step = {"samples_seen": samples_seen, "global_batch_size": batch, "lr": best_lrs.get(batch)}
            # A doubling at the very start replaces the reference batch rather than adding a second threshold 0.
            steps[-1:] = [step] if samples_seen == steps[-1]["samples_seen"] else [steps[-1], step]
    return steps


def megatron_schedule(steps: Sequence[ScheduleStep]) -> str:
    """The schedule as Megatron-LM's ``--step-batch-size-schedule`` reads it: space-separated ``SAMPLES:BATCH``
    pairs, thresholds in samples (no ``--seq-length``), the first at 0, strictly increasing.

    >>> megatron_schedule([{"samples_seen": 0, "global_batch_size": 8, "lr": 0.1},
    ...                    {"samples_seen": 1000, "global_batch_size": 16, "lr": 0.2}])
    '0:8 1000:16'
    """
    return " ".join(f"{step['samples_seen']}:{step['global_batch_size']}" for step in steps)
