"""How a loss was normalised, judged from what its elements weighed on every rank and micro-batch (pure Python).

A data-parallel reduction sums the W ranks' gradients and divides by D (D = W for DDP's and FSDP2's average, 1 for a
reduction that sums: :class:`~ddplab.runtime.reduction.Reduction`), so a step computes the mean over the global
batch's N elements (tokens, or samples) exactly when every element weighs D/N in its own rank's backward. Each rank
records, per loss line and micro-batch, the weight w of its counted elements and their count c
(:mod:`ddplab.auditor.weights`). Over one optimizer step:

- every w equal: one normaliser for the whole step, M = 1/w elements, and the step's gradient is w·N/D times the
  global mean's: w·N/D = 1/W under an average is a global count without × W (``GLOBAL_COUNT_WITHOUT_WORLD_SIZE``);
  w = W/N under a reduction that does not average is the average's recipe under a sum (``DIVIDE_FACTOR``); w = D/N
  is right, and anything else is a constant scale (silent). The factors of W are judged with a tolerance that
  separates them (:data:`NEAR`): a count a few per cent off the loss's own is still W times off without × W;
- one w per rank, with w times the rank's count equal across ranks: each rank divided by its own count
  (``LOSS_NORMALISED_PER_DEVICE``);
- w varying within a rank, with w·c equal over every micro-batch: each micro-batch divided by its own count
  (``LOSS_NORMALISED_PER_MICRO_BATCH``);
- anything else is not a normalisation by a count: nothing is said.

The scale is judged apart from the weighting: where an engine's backward divided by the accumulation steps K itself,
a step whose elements weigh 1/K in all of what its reduction calls for (Σ w·c = D/K) was divided by K twice
(``ACCUMULATION_DIVIDED_TWICE``), whether its elements weighed alike or each micro-batch by its own count: the two
effects of one loss are both the step's (:func:`divided_twice`). Where nothing divided by K, means over each
micro-batch's own count that weigh K in all (Σ w·c = K·D) were never divided by it (``ACCUMULATION_NOT_DIVIDED``,
beside ``LOSS_NORMALISED_PER_MICRO_BATCH``: :func:`not_divided`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

# Two weights within this relative distance are equal: float32's 1/n.
TOLERANCE = 1e-4
# A normaliser this close (relatively) to a count is that count: a count that includes a token per sequence the loss
# does not use (labels shifted twice) differs from the loss's own by 1-10%; the factors it must tell apart differ by
# W >= 2, so a quarter keeps them apart (1/W · 1.25 < 1).
NEAR = 0.25
# What the reduction divides the ranks' summed gradients by: the data-parallel size (an average), a number, or unknown.
Divisor = float | Literal["average"] | None
AVERAGE: Divisor = "average"


@dataclasses.dataclass(frozen=True)
class Part:
    """One loss line's elements on one rank in one micro-batch of a step."""

    rank: int
    micro_step: int
    weight: float
    count: float
    """The units weighed: tokens, samples, elements; the summed class weights of a class-weighted mean."""


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


def judge(parts: list[Part], world_size: int, step: int, divisor: Divisor = AVERAGE,
          engine_divides_by: int = 1) -> Judgement | None:
    """The finding one loss line's parts in one step give, if any.

    ``world_size``: the data-parallel ranks (W); ``divisor``: what the reduction divides their summed gradients by
    (D; :data:`AVERAGE` for W; None where it is unknown, so that no judgement of the scale is made);
    ``engine_divides_by``: the accumulation steps an engine's backward divided the loss by itself (DeepSpeed's), in
    the weights already.
    """
    if len({p.rank for p in parts}) < 2 and len(parts) < 2:
        return None
    total = sum(p.count for p in parts)
    if _equal(p.weight for p in parts):
        divisor = float(world_size) if divisor == AVERAGE else divisor
        return _one_normaliser(parts, world_size, step, divisor, total, engine_divides_by)
    weighting = _weighting(parts)
    if weighting is None:
        return None  # not one constant over each part's own count: nothing to attribute
    code, by_rank, spread = weighting
    detail = _unequal_detail(parts, by_rank, code == "LOSS_NORMALISED_PER_MICRO_BATCH", total)
    return Judgement(code, step, detail, spread)


def _weighting(parts: list[Part]) -> tuple[str, dict[int, list[Part]], float] | None:
    """Unequal weights attributed to a count: (the finding, the parts by rank, the spread of the weights); None
    where no count explains them."""
    by_rank: dict[int, list[Part]] = {}
    for part in parts:
        by_rank.setdefault(part.rank, []).append(part)
    spread = max(p.weight for p in parts) / min(p.weight for p in parts)
    if all(_equal(p.weight for p in own) for own in by_rank.values()):
        # One weight per rank: each rank's step divided by its own count, if weight × the rank's count agrees.
        attributed = _follows([own[0].weight * sum(p.count for p in own) for own in by_rank.values()], spread)
        code = "LOSS_NORMALISED_PER_DEVICE"
    else:
        attributed = _follows([p.weight * p.count for p in parts], spread)
        code = "LOSS_NORMALISED_PER_MICRO_BATCH"
    return (code, by_rank, spread) if attributed else None


def divided_twice(parts: list[Part], world_size: int, step: int, divisor: Divisor = AVERAGE,
                  engine_divides_by: int = 1) -> Judgement | None:
    """Elements weighed unequally (which :func:`judge` names) whose weights sum to 1/K of what the reduction calls
    for, K the accumulation steps an engine's backward divided by itself: the loss was divided by K before it.

    A mean over each micro-batch's own elements, the engine's 1/K in it, sums to D over the step (each of the K
    micro-batches of the W ranks weighs 1/K): D/K is a second 1/K, whatever weighed the elements unequally.
    """
    if engine_divides_by < 2 or world_size < 2 or divisor is None or _equal(p.weight for p in parts):
        return None
    divisor = float(world_size) if divisor == AVERAGE else divisor
    scale = sum(p.weight * p.count for p in parts) / divisor  # the gradient's size over a mean's of the same weights
    if not _near(scale, 1 / engine_divides_by):
        return None
    factor = _factor(scale, 1 / engine_divides_by, f"1/{engine_divides_by}")
    return Judgement("ACCUMULATION_DIVIDED_TWICE", step,
                     f"the step's elements weighed {scale:.4g} in all after the engine's own division by the "
                     f"{engine_divides_by} accumulation steps, where a mean over the step's elements, however they "
                     f"are weighed among themselves, weighs 1: the gradient is {factor} of that mean's", 1.0)


def not_divided(parts: list[Part], world_size: int, step: int, divisor: Divisor = AVERAGE,
                engine_divides_by: int = 1) -> Judgement | None:
    """Elements weighed by each micro-batch's own count (which :func:`judge` names) whose weights sum to K times
    what the reduction calls for, K the micro-batches each rank accumulated: each micro-batch's mean went to
    backward undivided by the accumulation steps (a Trainer's ``compute_loss`` override that skips the Trainer's
    own ÷K, a loop that never divides).

    A mean over each micro-batch's own elements weighs 1 per micro-batch: K micro-batches of W ranks weigh K·W, so
    the step's gradient is K times a mean over the step's elements weighed the same way.
    """
    if engine_divides_by > 1 or world_size < 2 or divisor is None or _equal(p.weight for p in parts):
        return None
    micro_batches = {len({p.micro_step for p in parts if p.rank == rank}) for rank in {p.rank for p in parts}}
    if len(micro_batches) != 1 or (steps := micro_batches.pop()) < 2:
        return None
    weighting = _weighting(parts)
    if weighting is None or weighting[0] != "LOSS_NORMALISED_PER_MICRO_BATCH":
        return None  # one weight per rank, or no count explains the weights: not each micro-batch's own mean
    divisor = float(world_size) if divisor == AVERAGE else divisor
    scale = sum(p.weight * p.count for p in parts) / divisor
    if not _near(scale, steps):
        return None
    factor = _factor(scale, steps, f"{steps}")
    return Judgement("ACCUMULATION_NOT_DIVIDED", step,
                     f"the step's elements weighed {scale:.4g} in all over its {steps} micro-batches per rank, where "
                     f"a mean over the step's elements, however they are weighed among themselves, weighs 1: each "
                     f"micro-batch's mean reached backward undivided by the {steps} accumulation steps, and the "
                     f"gradient is {factor} times that mean's", 1.0)


def _follows(products: list[float], spread: float) -> bool:
    """Whether weight × count is one constant: exactly, or near enough (a count a token per sequence off the loss's
    own) while the weights themselves differ far more than the products do."""
    if _equal(products):
        return True
    product_spread = max(products) / min(products)
    return product_spread - 1 <= NEAR and product_spread - 1 <= (spread - 1) / 10


def _one_normaliser(parts: list[Part], world_size: int, step: int, divisor: float | None, total: float,
                    engine_divides_by: int = 1) -> Judgement | None:
    """Every element weighed the same w: the step's loss was divided by one number, M = 1/w elements."""
    if world_size < 2 or divisor is None:
        return None
    scale = parts[0].weight * total / divisor  # the gradient over the global mean's
    if engine_divides_by > 1 and _near(scale, 1 / engine_divides_by):
        return Judgement("ACCUMULATION_DIVIDED_TWICE", step,
                         _twice_detail(parts, total, divisor, engine_divides_by), 1.0)
    if len({p.count for p in parts}) < 2:
        # Equal counts everywhere: a mean over each part's own elements times a constant (0.5 · a KL term) weighs
        # exactly what a global count does; only counts that differ show which one divided.
        return None
    if math.isclose(divisor, world_size, rel_tol=TOLERANCE) and _near(scale, 1 / world_size):
        return Judgement("GLOBAL_COUNT_WITHOUT_WORLD_SIZE", step,
                         _global_detail(parts, world_size, total, divisor), 1.0)
    if not math.isclose(divisor, world_size, rel_tol=TOLERANCE) and _near(scale, world_size / divisor):
        return Judgement("DIVIDE_FACTOR", step, _divide_factor_detail(parts, world_size, total, divisor), 1.0)
    return None


def _near(value: float, target: float) -> bool:
    return abs(value - target) <= NEAR * target


def relative_weights(parts: list[Part]) -> tuple[float, float]:
    """The smallest and largest element weight relative to a mean over all the step's elements (1 = fair)."""
    total = sum(p.count for p in parts)
    mass = sum(p.weight * p.count for p in parts)
    return min(p.weight for p in parts) * total / mass, max(p.weight for p in parts) * total / mass


def _unequal_detail(parts: list[Part], by_rank: dict[int, list[Part]], per_micro_batch: bool, total: int) -> str:
    low, high = relative_weights(parts)
    fair = f"{low:.2f}× to {high:.2f}× what a mean over the step's {_shown(total)} elements gives each"
    if per_micro_batch:
        rank, own = max(by_rank.items(), key=lambda item: _ratio(item[1]))
        counts = ", ".join(_shown(p.count) for p in sorted(own, key=lambda p: p.micro_step))
        light, heavy = min(own, key=lambda p: p.weight), max(own, key=lambda p: p.weight)
        return (f"each micro-batch's loss was divided by its own element count: on rank {rank} the micro-batches "
                f"held {counts} elements, so an element of micro-batch {heavy.micro_step} weighed "
                f"{heavy.weight / light.weight:.3g}× one of micro-batch {light.micro_step}; elements weighed {fair}")
    counts = {rank: sum(p.count for p in own) for rank, own in by_rank.items()}
    light_rank, heavy_rank = max(counts, key=counts.get), min(counts, key=counts.get)
    ratio = by_rank[heavy_rank][0].weight / by_rank[light_rank][0].weight
    held = ", ".join(f"rank {rank} {_shown(count)}" for rank, count in sorted(counts.items()))
    return (f"each rank divided by its own element count ({held}): an element on rank {heavy_rank} weighed "
            f"{ratio:.3g}× one on rank {light_rank}; elements weighed {fair}")


def _ratio(parts: list[Part]) -> float:
    return max(p.weight for p in parts) / min(p.weight for p in parts)


def _normaliser(parts: list[Part], total: int, times: float = 1.0) -> str:
    """What the loss was divided by, against the loss's own element count, where the two differ."""
    normaliser = times / parts[0].weight
    if math.isclose(normaliser, total, rel_tol=TOLERANCE):
        return f"every element weighed {times:g}/{_shown(total)}, {times:g} over the step's {_shown(total)} elements"
    return (f"every element weighed {times:g}/{normaliser:,.0f}: the count divides by {normaliser:,.0f} elements, "
            f"where the loss uses {_shown(total)} over the step's micro-batches and ranks "
            f"({normaliser / total - 1:+.1%})")


def _shown(count: float) -> str:
    """A count as the report prints it: whole units with thousands separators, summed class weights to 4 digits."""
    return f"{count:,}" if float(count).is_integer() else f"{count:,.4g}"


def _global_detail(parts: list[Part], world_size: int, total: int, divisor: float) -> str:
    scale = parts[0].weight * total / divisor
    factor = _factor(scale, 1 / world_size, f"1/{world_size}")
    return (f"{_normaliser(parts, total)} on all {world_size} data-parallel ranks, and the reduction divides the "
            f"ranks' summed gradients by {divisor:g}: the gradient is {factor} of the global mean's")


def _twice_detail(parts: list[Part], total: float, divisor: float, steps: int) -> str:
    scale = parts[0].weight * total / divisor
    factor = _factor(scale, 1 / steps, f"1/{steps}")
    return (f"every element weighed 1/{1 / parts[0].weight:,.0f} after the engine's own division by the {steps} "
            f"accumulation steps, where the step's {_shown(total)} elements over the ranks call for "
            f"{divisor:g}/{_shown(total)}: the gradient is {factor} of the global mean's")


def _divide_factor_detail(parts: list[Part], world_size: int, total: int, divisor: float) -> str:
    scale = parts[0].weight * total / divisor
    expected = world_size / divisor
    return (f"{_normaliser(parts, total, world_size)} on all {world_size} data-parallel ranks (× {world_size}, for "
            f"an average), but the reduction divides the ranks' summed gradients by {divisor:g}: the gradient is "
            f"{_factor(scale, expected, f'{expected:g}')} times the global mean's")


def _factor(value: float, exact: float, name: str) -> str:
    """``name`` where ``value`` is ``exact``; else the value, and the factor it is near."""
    return name if math.isclose(value, exact, rel_tol=TOLERANCE) else f"{value:.3g} (about {name})"


def judge_windows(windows: dict[tuple[str, int], dict[int, dict]], divisor: Divisor = AVERAGE) -> list[Judgement]:
    """Every step of every model, every loss line: the strongest judgement of each kind (``divisor``: the
    reduction's D, as in :func:`judge`)."""
    best: dict[str, Judgement] = {}
    for (_, step), by_rank in sorted(windows.items(), key=lambda item: item[0][1]):
        world = max((len(w.get("group", [])) for w in by_rank.values()), default=len(by_rank))
        engine = max((int(w.get("engine_divides_by", 1)) for w in by_rank.values()), default=1)
        for site, parts in _parts_by_site(by_rank).items():
            if {p.rank for p in parts} != set(by_rank) or _repeated(parts):
                # A loss some ranks never computed (rank-dependent code), or one line computing several losses in
                # a micro-batch (a loop over tasks, each its own mean): nothing to compare element for element.
                continue
            for judgement in (judge(parts, world, step, divisor, engine),
                              divided_twice(parts, world, step, divisor, engine),
                              not_divided(parts, world, step, divisor, engine)):
                if judgement is not None and (judgement.code not in best
                                              or judgement.spread > best[judgement.code].spread):
                    best[judgement.code] = dataclasses.replace(
                        judgement, detail=f"at optimizer step {step}, {site}: {judgement.detail}{_scaled(by_rank)}")
    return list(best.values())


def _scaled(by_rank: dict[int, dict]) -> str:
    """The program's own scaling of the step's gradients between backward and the step, where there was one: the
    weights above include it (:mod:`ddplab.auditor.grad_scaling`)."""
    factors = {rank: w["grad_scale"] for rank, w in by_rank.items() if "grad_scale" in w}
    if not factors:
        return ""
    values = set(f"{factor:.4g}" for factor in factors.values())
    each = (f"×{values.pop()} on every rank" if len(values) == 1 and len(factors) == len(by_rank) else
            ", ".join(f"rank {rank} ×{factors.get(rank, 1.0):.4g}" for rank in sorted(by_rank)))
    return f" (these weights include the program's scaling of the gradients after backward: {each})"


def _repeated(parts: list[Part]) -> bool:
    return len({(p.rank, p.micro_step) for p in parts}) < len(parts)


def _count(value) -> float:
    # Tokens and samples are whole; summed class weights (a weighted mean's divisor) keep their fraction.
    value = float(value)
    return int(value) if value.is_integer() else value


def _parts_by_site(by_rank: dict[int, dict]) -> dict[str, list[Part]]:
    out: dict[str, list[Part]] = {}
    for rank, window in by_rank.items():
        for site, rows in (window.get("loss_weights") or {}).items():
            out.setdefault(site, []).extend(Part(rank, int(m), float(w), _count(c)) for m, w, c in rows)
    return out
