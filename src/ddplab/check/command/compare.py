"""What two runs of one command computed, step by step: ratios and cosines of the gradients and updates (torch-free).

Each side's records (:mod:`ddplab.check.command.guest`) are merged into one view per optimizer step: a sharded
parameter's blocks summed over the ranks that hold them, a replicated one taken from its lowest rank (and the
other ranks' copies compared with it). Per parameter, and per top-level module (the first word of the name):

- ``gradient_ratio`` = |g_ranks| / |g_one|, exact (squared norms are summed exactly);
- ``cosine``, from the sketches: 1 − cos = |s(g_ranks) − r·s(g_one)|² / (2|g_ranks|²) with r the ratio, so a pure
  scale is cos 1 to rounding, and a real difference is estimated to a few percent of 1 − cos (exact for tensors of
  at most :data:`ddplab.check.command.config.BUCKETS` elements);
- ``difference``: |g_ranks − g_one| / |g_one|, the relative difference the verdict is judged on.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any

Sketch = list[float]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Vector:
    """One parameter's gradient or update on one side, merged over the ranks: exact |x|² and its sketch."""

    sq: float
    sketch: Sketch


@dataclasses.dataclass(frozen=True, kw_only=True)
class Parameter:
    """What one side's step read of one parameter."""

    key: str
    name: str | None
    shape: tuple[int, ...]
    dtype: str
    grad: Vector | None
    param_before: Vector
    update: Vector
    replica_difference: float = 0.0
    """Largest relative difference between this rank's gradient and the other ranks' copies (unsharded)."""
    update_replica_difference: float = 0.0
    """The same for the update each rank's step made (unsharded)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Comparison:
    """One quantity (a parameter's, a module's or the model's gradient or update) on the two sides."""

    gradient_ratio: float | None
    cosine: float | None
    difference: float | None
    exact: bool

    def to_json(self) -> dict[str, Any]:
        return {"gradient_ratio": self.gradient_ratio, "cosine": self.cosine, "difference": self.difference,
                "exact": self.exact}


def merge_side(events: list[dict]) -> dict[tuple[int, int], dict[str, Parameter]]:
    """(optimizer, step) → parameter key → what that step read, over every rank of one side."""
    by_step: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for event in events:
        if event.get("kind") == "step":
            by_step[(event["optimizer"], event["step"])].append(event)
    return {step: _merge_step(records) for step, records in sorted(by_step.items())}


def _merge_step(records: list[dict]) -> dict[str, Parameter]:
    records = sorted(records, key=lambda r: r["rank"])
    merged = {}
    for key, first in records[0]["params"].items():
        entries = [r["params"][key] for r in records if key in r["params"]]
        merged[key] = _merge_parameter(key, first, entries)
    return merged


def _merge_parameter(key: str, first: dict, entries: list[dict]) -> Parameter:
    sharded = first.get("sharded", False)
    pick = _summed if sharded else _first
    # The gradient the step used: read after it where the step changed it, before it otherwise.
    gradients = [_gradient(e) for e in entries]
    has_grad = any(g.get("grad_sq") is not None for g in gradients)
    before, after = pick(entries, "param_before"), pick(entries, "param_after")
    change = _minus(after.sketch, before.sketch)
    update = Vector(sq=_sq(change), sketch=change)
    grad = pick(gradients, "grad") if has_grad else None
    replicas = 0.0 if sharded or not has_grad else _replica_difference(gradients, "grad")
    updates = 0.0 if sharded else _replica_difference([_update(e) for e in entries], "update")
    return Parameter(key=key, name=first.get("name"), shape=tuple(first["shape"]), dtype=first["dtype"],
                     grad=grad, param_before=before, update=update,
                     replica_difference=replicas, update_replica_difference=updates)


def _update(entry: dict) -> dict:
    """One rank's update: its sketch after the step less before it."""
    change = _minus(entry.get("param_after") or [], entry.get("param_before") or [])
    return {"update": change, "update_sq": _sq(change)}


def _gradient(entry: dict) -> dict:
    if entry.get("grad_after_sq") is not None:
        return {"grad_sq": entry["grad_after_sq"], "grad": entry.get("grad_after")}
    return {"grad_sq": entry.get("grad_sq"), "grad": entry.get("grad")}


def _summed(entries: list[dict], field: str) -> Vector:
    sketches = [e[field] for e in entries if e.get(field) is not None]
    total = [math.fsum(column) for column in zip(*sketches)] if sketches else []
    return Vector(sq=math.fsum(e.get(f"{field}_sq") or 0.0 for e in entries), sketch=total)


def _first(entries: list[dict], field: str) -> Vector:
    entry = entries[0]
    return Vector(sq=entry.get(f"{field}_sq") or 0.0, sketch=entry.get(field) or [])


def _replica_difference(entries: list[dict], field: str) -> float:
    reference = entries[0].get(field)
    scale = math.sqrt(entries[0].get(f"{field}_sq") or 0.0)
    if not reference or scale == 0:
        return 0.0
    return max((math.sqrt(_sq(_minus(e[field], reference))) / scale for e in entries[1:] if e.get(field)),
               default=0.0)


def _minus(a: Sketch, b: Sketch, scale: float = 1.0) -> Sketch:
    return [x - scale * y for x, y in zip(a, b)]


def _sq(values: Sketch) -> float:
    return math.fsum(x * x for x in values)


def matching_optimizers(ranks: dict[tuple[int, int], dict[str, Parameter]],
                        one: dict[tuple[int, int], dict[str, Parameter]]) -> tuple[set[int], set[int]]:
    """(the optimizers whose first step holds parameters of the same shapes, in order, on both sides; the others)."""
    def shapes(merged, optimizer):
        first = min((key for key in merged if key[0] == optimizer), default=None)
        return None if first is None else [p.shape for p in merged[first].values()]

    optimizers = {key[0] for key in ranks} | {key[0] for key in one}
    kept = {o for o in optimizers if shapes(ranks, o) is not None and shapes(ranks, o) == shapes(one, o)}
    return kept, optimizers - kept


def compare(ranks: list[Vector | None], one: list[Vector | None], exact: bool) -> Comparison:
    """Ranks' side against the one process's, over the parameters given (their vectors concatenated)."""
    pairs = [(a, b) for a, b in zip(ranks, one) if a is not None and b is not None]
    sq_a, sq_b = math.fsum(a.sq for a, _ in pairs), math.fsum(b.sq for _, b in pairs)
    if not pairs or sq_b == 0:
        return Comparison(gradient_ratio=None, cosine=None, difference=None, exact=exact)
    ratio = math.sqrt(sq_a / sq_b)
    apart = math.fsum(_sq(_minus(a.sketch, b.sketch, ratio)) for a, b in pairs)
    cosine = 1.0 - apart / (2 * sq_a) if sq_a > 0 else 0.0
    difference = math.sqrt(math.fsum(_sq(_minus(a.sketch, b.sketch)) for a, b in pairs) / sq_b)
    return Comparison(gradient_ratio=ratio, cosine=max(-1.0, min(1.0, cosine)), difference=difference, exact=exact)


def module_of(name: str | None, key: str) -> str:
    """The top-level module a parameter belongs to: its name's first word (the optimizer position without one)."""
    if not name:
        return f"param {key}"
    return name.split(".")[0]
