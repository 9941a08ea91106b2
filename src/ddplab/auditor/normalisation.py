"""How a loss was normalised, judged from what its elements weighed on every rank and micro-batch (pure Python).

DDP and FSDP2 average gradients over the W data-parallel ranks, so a step computes the mean over the global batch's
N elements (tokens, or samples) exactly when every element weighs W/N in its own rank's backward. Each rank records,
per loss line and micro-batch, the weight w of its counted elements and their count c
(:mod:`ddplab.auditor.weights`). Over one optimizer step:

- every w equal: one normaliser for the whole step; w·N = 1 means a global count without × W
  (``GLOBAL_COUNT_WITHOUT_WORLD_SIZE``), W/N is right, and anything else is a constant scale (silent);
- one w per rank, with w times the rank's count equal across ranks: each rank divided by its own count
  (``LOSS_NORMALISED_PER_DEVICE``);
- w varying within a rank, with w·c equal over every micro-batch: each micro-batch divided by its own count
  (``LOSS_NORMALISED_PER_MICRO_BATCH``);
- anything else is not a normalisation by a count: nothing is said.
"""

from __future__ import annotations

import dataclasses
import math

# Two weights (or weight × count products) within this relative distance are equal: float32's 1/n.
TOLERANCE = 1e-4


@dataclasses.dataclass(frozen=True)
class Part:
    """One loss line's elements on one rank in one micro-batch of a step."""

    rank: int
    micro_step: int
    weight: float
    count: int


@dataclasses.dataclass(frozen=True)
class Judgement:
    """What one step's parts of one loss line show."""

    code: str
    step: int
    detail: str
    spread: float  # the largest weight over the smallest: how unequal the elements were


def _equal(values) -> bool:
    values = list(values)
    return max(values) - min(values) <= TOLERANCE * max(abs(v) for v in values)


def judge(parts: list[Part], world_size: int, step: int) -> Judgement | None:
    """The finding one loss line's parts in one step give, if any (``world_size``: the data-parallel ranks)."""
    if len({p.rank for p in parts}) < 2 and len(parts) < 2:
        return None
    total = sum(p.count for p in parts)
    if _equal(p.weight for p in parts):
        if world_size > 1 and math.isclose(parts[0].weight * total, 1.0, rel_tol=TOLERANCE):
            return Judgement("GLOBAL_COUNT_WITHOUT_WORLD_SIZE", step, _global_detail(parts, world_size, total), 1.0)
        return None
    by_rank: dict[int, list[Part]] = {}
    for part in parts:
        by_rank.setdefault(part.rank, []).append(part)
    if all(_equal(p.weight for p in own) for own in by_rank.values()):
        # One weight per rank: each rank's step divided by its own count, if weight × the rank's count agrees.
        attributed = _equal(own[0].weight * sum(p.count for p in own) for own in by_rank.values())
        code = "LOSS_NORMALISED_PER_DEVICE"
    else:
        attributed = _equal(p.weight * p.count for p in parts)
        code = "LOSS_NORMALISED_PER_MICRO_BATCH"
    if not attributed:
        return None  # not one constant over each part's own count: nothing to attribute
    spread = max(p.weight for p in parts) / min(p.weight for p in parts)
    detail = _unequal_detail(parts, by_rank, code == "LOSS_NORMALISED_PER_MICRO_BATCH", total)
    return Judgement(code, step, detail, spread)


def relative_weights(parts: list[Part]) -> tuple[float, float]:
    """The smallest and largest element weight relative to a mean over all the step's elements (1 = fair)."""
    total = sum(p.count for p in parts)
    mass = sum(p.weight * p.count for p in parts)
    return min(p.weight for p in parts) * total / mass, max(p.weight for p in parts) * total / mass


def _unequal_detail(parts: list[Part], by_rank: dict[int, list[Part]], per_micro_batch: bool, total: int) -> str:
    low, high = relative_weights(parts)
    fair = f"{low:.2f}× to {high:.2f}× what a mean over the step's {total} elements gives each"
    if per_micro_batch:
        rank, own = max(by_rank.items(), key=lambda item: _ratio(item[1]))
        counts = ", ".join(str(p.count) for p in sorted(own, key=lambda p: p.micro_step))
        light, heavy = min(own, key=lambda p: p.weight), max(own, key=lambda p: p.weight)
        return (f"each micro-batch's loss was divided by its own element count: on rank {rank} the micro-batches "
                f"held {counts} elements, so an element of micro-batch {heavy.micro_step} weighed "
                f"{heavy.weight / light.weight:.3g}× one of micro-batch {light.micro_step}; elements weighed {fair}")
    counts = {rank: sum(p.count for p in own) for rank, own in by_rank.items()}
    light_rank, heavy_rank = max(counts, key=counts.get), min(counts, key=counts.get)
    ratio = by_rank[heavy_rank][0].weight / by_rank[light_rank][0].weight
    held = ", ".join(f"rank {rank} {count}" for rank, count in sorted(counts.items()))
    return (f"each rank divided by its own element count ({held}): an element on rank {heavy_rank} weighed "
            f"{ratio:.3g}× one on rank {light_rank}; elements weighed {fair}")


def _ratio(parts: list[Part]) -> float:
    return max(p.weight for p in parts) / min(p.weight for p in parts)


def _global_detail(parts: list[Part], world_size: int, total: int) -> str:
    return (f"every element weighed 1/{total}, one over the step's {total} elements on all {world_size} "
            f"data-parallel ranks, and the gradients are then averaged over those {world_size} ranks: the gradient "
            f"is 1/{world_size} of the global mean's")


def judge_windows(windows: dict[tuple[str, int], dict[int, dict]]) -> list[Judgement]:
    """Every step of every model, every loss line: the strongest judgement of each kind."""
    best: dict[str, Judgement] = {}
    for (_, step), by_rank in sorted(windows.items(), key=lambda item: item[0][1]):
        world = max((len(w.get("group", [])) for w in by_rank.values()), default=len(by_rank))
        for site, parts in _parts_by_site(by_rank).items():
            if {p.rank for p in parts} != set(by_rank) or _repeated(parts):
                # A loss some ranks never computed (rank-dependent code), or one line computing several losses in
                # a micro-batch (a loop over tasks, each its own mean): nothing to compare element for element.
                continue
            judgement = judge(parts, world, step)
            if judgement is not None and (judgement.code not in best or judgement.spread > best[judgement.code].spread):
                best[judgement.code] = dataclasses.replace(judgement, detail=f"at optimizer step {step}, {site}: "
                                                                            f"{judgement.detail}")
    return list(best.values())


def _repeated(parts: list[Part]) -> bool:
    return len({(p.rank, p.micro_step) for p in parts}) < len(parts)


def _parts_by_site(by_rank: dict[int, dict]) -> dict[str, list[Part]]:
    out: dict[str, list[Part]] = {}
    for rank, window in by_rank.items():
        for site, rows in (window.get("loss_weights") or {}).items():
            out.setdefault(site, []).extend(Part(rank, int(m), float(w), int(c)) for m, w, c in rows)
    return out
