"""Every rank's record of a measured command merged into measured steps (pure: no torch).

For one optimizer step, each rank r of the data-parallel group wrote |g_r|², the squared norm of its local
gradient over its b samples, and its disjoint share of |G_B|², the squared norm of the averaged gradient over
B = W·b. The small batch's squared norm is the mean over ranks, E|g_b|² ≈ (1/W)·Σ|g_r|², and the big one's the
sum of the shares. Where an engine reduces every micro-batch (DeepSpeed ZeRO-2) no rank's step gradient exists
whole: |g_r|² is then the mean over its K micro-batches, each a small batch of b/K samples. A step enters only when
every rank of the group recorded it, once reduced, with equal batches; the others are counted with the reason.

A step's tokens are the targets its class-index loss kept, summed over the ranks, where every rank called that loss
once per training forward over more targets than samples (one per position of a sequence): a language model's.
"""

from __future__ import annotations

import collections
import dataclasses
import math

WITHOUT_ACCUMULATION = "one micro-step per optimizer step on one rank (no accumulation)"


@dataclasses.dataclass(frozen=True)
class StepNorms:
    """One measured optimizer step, merged over the ranks."""

    step: int
    b_small: int
    """Samples behind each rank's local gradient (its micro-batches together)."""
    b_big: int
    """Samples behind the reduced gradient: the global batch."""
    forwards: int
    """Training forwards per rank in the step (its micro-steps)."""
    g_small_sq: float
    g_big_sq: float
    dataset_size: int | None
    tokens: int | None = None
    """The global batch's tokens (the targets its token loss kept); None where no token loss was seen."""
    token_loss: str | None = None
    """The class-index loss the ranks called over more targets than samples (cross_entropy, nll_loss), counted or
    not."""


@dataclasses.dataclass(frozen=True)
class Merged:
    """What the command's processes recorded, merged."""

    strategy: str | None
    world_size: int | None
    group: list[int]
    """The data-parallel ranks measured."""
    steps: list[StepNorms]
    left_out: dict[str, int]
    """Measured steps left out, by reason."""
    notes: list[str]
    """Why the guest disarmed, where it did (one per distinct reason)."""
    optimizer_steps: int | None
    """Optimizer steps counted on rank 0 (to its exit, or to the last measured step)."""
    guest_s: float
    """The guest's own seconds per measured step (mean over steps, largest over ranks)."""
    step_s: float | None
    """Median seconds of a measured step, on the slowest rank."""


def merge(events: list[dict]) -> Merged:
    models = [e for e in events if e["kind"] == "model"]
    first = min(models, key=lambda e: e["rank"], default=None)
    group = first["group"] if first else []
    mine = [e for e in events if e.get("rank") in set(group)]
    by_step: dict[int, dict[int, dict]] = collections.defaultdict(dict)
    for event in mine:
        if event["kind"] == "step":
            by_step[event["step"]][event["rank"]] = event
    steps, left_out = [], collections.Counter()
    for step in sorted(by_step):
        merged, reason = _merge_step(step, by_step[step], group)
        if merged is None:
            left_out[reason] += 1
        else:
            steps.append(merged)
    notes = list(dict.fromkeys(e["text"] for e in mine if e["kind"] == "note"))
    ends = [e["steps"] for e in mine if e["kind"] == "end" and e["rank"] == min(group, default=0)]
    return Merged(strategy=first and first["strategy"], world_size=first and first["world_size"], group=group,
                  steps=steps, left_out=dict(left_out), notes=notes, optimizer_steps=max(ends, default=None),
                  **_costs(by_step, group))


def _merge_step(step: int, ranks: dict[int, dict], group: list[int]) -> tuple[StepNorms | None, str]:
    if set(ranks) != set(group):
        return None, "not recorded by every rank (the run ended during the step)"
    records = list(ranks.values())
    if records[0].get("micro"):
        return _merge_micro_step(step, records[0])
    if any(r["reductions"] != 1 or r["share_sq"] is None for r in records):
        return None, ("not exactly one reducing backward pass in the step (each micro-batch reduced, or a step "
                      "the GradScaler skipped)")
    samples = {r["samples"] for r in records}
    if samples == {0}:
        return None, "the batch size could not be read from the model's inputs (give --batch-size)"
    if len(samples) != 1:
        return None, "the ranks' batches differed in size (a last, short batch)"
    g_small_sq = sum(r["local_sq"] for r in records) / len(records)
    g_big_sq = sum(r["share_sq"] for r in records)
    if not (math.isfinite(g_small_sq) and math.isfinite(g_big_sq)):
        return None, "non-finite gradients (an fp16 overflow, a NaN loss)"
    b_big = samples.pop() * len(group)
    # An engine that reduces every micro-batch (DeepSpeed ZeRO-2): each micro-batch is a small batch.
    per_rank = b_big // len(group)
    b_small = per_rank // records[0]["forwards"] if records[0].get("per_micro_batch") else per_rank
    size = ranks[min(ranks)]["dataset_size"]
    return StepNorms(step, b_small, b_big, records[0]["forwards"], g_small_sq, g_big_sq,
                     size if size is not None and size >= max(b_big, 2) else None, *_tokens(records)), ""


def _merge_micro_step(step: int, record: dict) -> tuple[StepNorms | None, str]:
    """One rank: each micro-step's gradient c_i a small batch of b, their sum the big one of A·b.

    With each micro-step's loss divided by A (the usual recipe) a micro-batch's gradient is A·c_i, so the mean
    over micro-batches of its squared norm is A·Σ|c_i|², and the accumulated Σc_i their mean; without the division
    both carry A², which B_simple does not see.
    """
    forwards, samples = record["forwards"], record["samples"]
    if forwards < 2:
        return None, WITHOUT_ACCUMULATION
    if samples == 0 or samples % forwards or record["share_sq"] is None:
        return None, "the micro-batches' sizes could not be read or differed (give --batch-size)"
    g_small_sq, g_big_sq = record["local_sq"] * forwards, record["share_sq"]
    if not (math.isfinite(g_small_sq) and math.isfinite(g_big_sq)):
        return None, "non-finite gradients (an fp16 overflow, a NaN loss)"
    size = record["dataset_size"]
    return StepNorms(step, samples // forwards, samples, forwards, g_small_sq, g_big_sq,
                     size if size is not None and size >= max(samples, 2) else None, *_tokens([record])), ""


def _tokens(records: list[dict]) -> tuple[int | None, str | None]:
    """(the step's tokens over its ranks, the class-index loss seen over more targets than samples): tokens only
    where every rank called that loss once per training forward."""
    name = next((r["token_loss"] for r in records if r.get("token_loss") and r["targets"] > r["samples"]), None)
    per_token = all(r.get("tokens") is not None and r["token_losses"] == r["forwards"] and r["targets"] > r["samples"]
                    for r in records)
    return (sum(r["tokens"] for r in records) if per_token else None), name


def _costs(by_step: dict[int, dict[int, dict]], group: list[int]) -> dict:
    complete = [ranks for ranks in by_step.values() if set(ranks) == set(group)]
    if not complete:
        return {"guest_s": 0.0, "step_s": None}
    guest = max(sum(ranks[r]["guest_s"] for ranks in complete) / len(complete) for r in group)
    slowest = sorted(max(r["step_s"] for r in ranks.values()) for ranks in complete)
    return {"guest_s": guest, "step_s": slowest[len(slowest) // 2]}
