"""Plan from the critical batch ``ddplab study`` measured over training by branching (``branched.json``):
where training is now, its last checkpoint whose branches told the critical batch (pure Python, no torch).

A checkpoint whose seeds' interval spans every batch branched tells nothing, and one at the grid's top is a lower
bound: neither becomes the plan's critical batch. The plan says the whole curve, each point with its interval, and
which point it took; the lr follows the plan's rule from the measurement's reference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ddplab.errors import UsageError, literal, render
from ddplab.plan import planner


def is_branched(loaded: Mapping[str, Any]) -> bool:
    """Whether a study JSON is a critical-batch measurement (``branched.json``), not a grid's ``study.json``."""
    return isinstance(loaded.get("branches"), list)


def plan_from_branches(reference: planner.Reference, target: planner.Target, data: planner.Data | None,
                       loaded: Mapping[str, Any], source: str, *, names: Mapping[str, str] | None = None,
                       before: tuple[str, ...] = ()) -> planner.Plan:
    """:func:`ddplab.plan.plan` with the last resolved checkpoint's critical batch as the data's; ``before``: the
    reference's contradictions, said first."""
    data = data or planner.Data()
    if data.critical_batch_size is not None:
        raise UsageError("{data.critical_batch_size} and {from_study} both give the critical batch size: drop one")
    points = [b for b in loaded["branches"] if isinstance(b, dict) and b.get("critical_batch_size")]
    if not points:
        raise UsageError(f"{{from_study}} {literal(repr(source))} holds no checkpoint with a critical batch: every "
                         "reference branch diverged")
    critical, said = taken(points, source)
    result = planner.plan(reference, target, dataclasses.replace(data, critical_batch_size=critical), names=names)
    first = tuple(render(warning, names) for warning in (*before, said))
    return dataclasses.replace(result, warnings=first + result.warnings)


def taken(points: list[dict], source: str) -> tuple[int | None, str]:
    """The critical batch the plan takes (None where no checkpoint resolves one inside the grid), and the sentence
    that says the curve and the choice.

    >>> points = [{"samples_seen": 416, "critical_batch_size": 64, "interval": [32, 64], "resolved": True},
    ...           {"samples_seen": 1248, "critical_batch_size": 128, "interval": [128, 256], "resolved": True},
    ...           {"samples_seen": 2496, "critical_batch_size": 512, "interval": [32, 512], "resolved": False}]
    >>> taken(points, "b.json")[0]
    128
    """
    curve = ", ".join(f"{p['critical_batch_size']} [{p['interval'][0]}, {p['interval'][1]}] at "
                      f"{p['samples_seen']:,} samples" for p in points)
    usable = [p for p in points if p.get("resolved", True) and not p.get("at_edge")]
    head = f"the critical batch over training ({literal(repr(source))}): {curve}"
    if not usable:
        return None, (f"{head}; no checkpoint places it inside the batches branched (each spans the grid or lies at "
                      "its top), so no critical batch is planned with")
    last = usable[-1]
    skipped = points[points.index(last) + 1:]
    later = f"; the later {_count(len(skipped), 'checkpoint')} placed none inside the grid" if skipped else ""
    return int(last["critical_batch_size"]), (f"{head}; planned with the last resolved one, "
                                              f"{last['critical_batch_size']} at {last['samples_seen']:,} samples "
                                              f"seen{later}")


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"
