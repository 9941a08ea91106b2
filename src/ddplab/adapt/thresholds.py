"""A batch schedule's thresholds, pure Python: read, checked, and looked up by samples seen.

A schedule is a list of ``{"samples_seen": n, "global_batch_size": B, "lr": x}`` (from n samples on,
train at global batch B with lr x), as ``ddplab study --branch-at/--branch-from`` writes it under
``schedule`` in ``branched.json``, or Megatron-LM's ``--step-batch-size-schedule`` string
``"0:32 416:64 1248:128"`` (thresholds in samples, no lrs). The first threshold is 0 and they
strictly increase; an entry without an lr keeps the lr of the one before.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence

from ddplab.errors import UsageError, literal


@dataclasses.dataclass(frozen=True)
class Threshold:
    """From ``samples_seen`` samples on, train at ``global_batch_size`` with ``lr``."""

    samples_seen: int
    global_batch_size: int
    lr: float | None = None
    """None: the lr of the threshold before (the first: the optimizer's own)."""


def parse(schedule) -> tuple[Threshold, ...]:
    """The thresholds of a list of entries, a Megatron-style string or a ``branched.json``/``schedule.json`` path.

    >>> parse("0:32 416:64 1248:128")[1]
    Threshold(samples_seen=416, global_batch_size=64, lr=None)
    >>> [t.lr for t in parse([{"samples_seen": 0, "global_batch_size": 8, "lr": 0.1},
    ...                       {"samples_seen": 96, "global_batch_size": 16, "lr": 0.2}])]
    [0.1, 0.2]
    """
    if isinstance(schedule, os.PathLike) or (isinstance(schedule, str) and (schedule.endswith(".json")
                                                                             or os.path.isfile(schedule))):
        return parse(read(os.fspath(schedule)))
    if isinstance(schedule, str):
        return parse_megatron(schedule)
    if not isinstance(schedule, Sequence) or not schedule:
        raise UsageError(f"{{schedule}} must be a non-empty list of entries, a Megatron-style string or a JSON "
                         f"file's path, got {literal(repr(schedule))}")
    return checked(tuple(_entry(i, entry) for i, entry in enumerate(schedule)))


def parse_megatron(text: str) -> tuple[Threshold, ...]:
    """Megatron-LM's ``--step-batch-size-schedule``: space-separated ``SAMPLES:BATCH`` pairs.

    >>> [(t.samples_seen, t.global_batch_size) for t in parse_megatron("0:8  1000:16")]
    [(0, 8), (1000, 16)]
    >>> parse_megatron("0:8 1000")
    Traceback (most recent call last):
    ...
    ddplab.errors.UsageError: schedule entry 1 '1000' must be SAMPLES:BATCH (two integers), as in '0:32 416:64'
    """
    entries = []
    for i, pair in enumerate(text.split()):
        samples, _, batch = pair.partition(":")
        if not (samples.isdigit() and batch.isdigit()):
            raise UsageError(f"{{schedule}} entry {i} {literal(repr(pair))} must be SAMPLES:BATCH (two integers), "
                             "as in '0:32 416:64'")
        entries.append(Threshold(int(samples), int(batch)))
    if not entries:
        raise UsageError("{schedule} is an empty string: give SAMPLES:BATCH pairs, as in '0:32 416:64'")
    return checked(tuple(entries))


def read(path: str) -> list[dict]:
    """The entries of a JSON file: a ``branched.json`` (its ``schedule``), or a list of entries itself."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{{schedule}} {literal(repr(path))} cannot be read as JSON: {literal(exc)}") from None
    entries = data.get("schedule") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise UsageError(f"{{schedule}} {literal(repr(path))} holds neither a list of entries nor a 'schedule' key "
                         "with one")
    return entries


def _entry(i: int, entry) -> Threshold:
    if not isinstance(entry, Mapping) or not {"samples_seen", "global_batch_size"} <= entry.keys():
        raise UsageError(f"{{schedule}} entry {i} must be a dict with samples_seen and global_batch_size "
                         f"(and lr), got {literal(repr(entry))}")
    lr = entry.get("lr")
    return Threshold(entry["samples_seen"], entry["global_batch_size"], None if lr is None else lr)


def checked(thresholds: tuple[Threshold, ...]) -> tuple[Threshold, ...]:
    """``thresholds`` unchanged, or a UsageError naming the first entry that is not a schedule's."""
    for i, t in enumerate(thresholds):
        if not (_integer(t.samples_seen) and t.samples_seen >= 0 and _integer(t.global_batch_size)
                and t.global_batch_size > 0):
            raise UsageError(f"{{schedule}} entry {i} needs samples_seen ≥ 0 and global_batch_size > 0 as integers, "
                             f"got {literal(repr(t.samples_seen))} and {literal(repr(t.global_batch_size))}")
        if t.lr is not None and not (isinstance(t.lr, (int, float)) and math.isfinite(t.lr) and t.lr > 0):
            raise UsageError(f"{{schedule}} entry {i} has lr {literal(repr(t.lr))}: it must be a positive number "
                             "(or left out)")
        if i == 0 and t.samples_seen != 0:
            raise UsageError(f"{{schedule}} entry 0 starts at samples_seen {t.samples_seen}: the first must be at 0")
        if i and t.samples_seen <= thresholds[i - 1].samples_seen:
            raise UsageError(f"{{schedule}} entry {i} at samples_seen {t.samples_seen} does not come after entry "
                             f"{i - 1} at {thresholds[i - 1].samples_seen}: thresholds must strictly increase")
    if thresholds[0].lr is None and any(t.lr is not None for t in thresholds):
        raise UsageError("{schedule} entry 0 has no lr but later ones do: the lrs are relative to the first one's")
    return thresholds


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def accumulation_steps(thresholds: Sequence[Threshold], samples_per_micro_step: int) -> tuple[int, ...]:
    """Each threshold's accumulation steps: its global batch ÷ (per-device batch × data-parallel size).

    >>> accumulation_steps(parse("0:32 416:64 1248:128"), 16)
    (2, 4, 8)
    >>> accumulation_steps(parse("0:32 416:48"), 32)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ddplab.errors.UsageError: schedule entry 1 (global batch 48 from 416 samples) is not a multiple of the 32 ...
    """
    steps = []
    for i, t in enumerate(thresholds):
        if t.global_batch_size % samples_per_micro_step:
            raise UsageError(f"{{schedule}} entry {i} (global batch {t.global_batch_size} from {t.samples_seen} "
                             f"samples) is not a multiple of the {samples_per_micro_step} samples one micro-step "
                             "trains (per-device batch × data-parallel size): change the entry or the per-device "
                             "batch")
        steps.append(t.global_batch_size // samples_per_micro_step)
    return tuple(steps)


def lr_factors(thresholds: Sequence[Threshold]) -> tuple[float, ...]:
    """Each threshold's lr relative to the first's (an entry without an lr keeps the one before; all 1 without lrs).

    >>> lr_factors(parse([{"samples_seen": 0, "global_batch_size": 8, "lr": 0.25},
    ...                   {"samples_seen": 96, "global_batch_size": 16},
    ...                   {"samples_seen": 200, "global_batch_size": 32, "lr": 0.75}]))
    (1.0, 1.0, 3.0)
    """
    factors, lr = [], thresholds[0].lr
    for t in thresholds:
        lr = t.lr if t.lr is not None else lr
        factors.append(1.0 if lr is None else lr / thresholds[0].lr)
    return tuple(factors)


def index_at(thresholds: Sequence[Threshold], samples_seen: int) -> int:
    """The threshold in force once ``samples_seen`` samples are trained: the last at or below it.

    >>> [index_at(parse("0:32 416:64 1248:128"), n) for n in (0, 415, 416, 1247, 5000)]
    [0, 0, 1, 1, 2]
    """
    return bisect.bisect_right([t.samples_seen for t in thresholds], samples_seen) - 1
