"""The critical batch from branches of a running training, and the batch schedule it implies (torch-free).

Merrill et al. (2025, "Critical batch size revisited") measure the critical batch where a training
is: from a checkpoint of the reference run (global batch B_ref), short branches train at B_ref·2^i
for the same number of samples, each with a small lr sweep, and the critical batch is the largest
batch whose branch still matches the reference batch's loss. Here, with each batch's best lr (the
fewest median end loss over seeds; a diverged run counts as inf):

- a batch *matches* when its best median end loss is at most the reference batch's plus the
  tolerance; the reference batch matches itself;
- the **critical batch** is the largest batch up to which every batch of the grid matches (a batch
  that matches after one that did not is taken for noise: with the samples fixed, a larger batch
  takes fewer steps);
- its **interval** judges each batch by its worst seed (every seed matches: the low end) and by
  its best seed (some seed matches: the high end), against the same reference loss and tolerance.
  Worst ≥ median ≥ best, so low ≤ critical ≤ high;
- the default **tolerance** is the reference batch's own seed spread: half the range of its best
  lr's end losses over the seeds (what the reference itself cannot tell apart). ``tolerance`` gives
  it in loss units; ``lag`` derives it from the reference's own progress (see :func:`lag_tolerance`).

The schedule (Merrill et al.'s batch size warmup): start at the reference batch and double it
whenever a checkpoint's critical batch reaches twice the batch then in use.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Literal

from ddplab.errors import UsageError
from ddplab.study.branched.checkpoint import Groups, Trained
from ddplab.study.fit import median

Losses = Mapping[int, Mapping[float, Sequence[float]]]
"""{global batch: {lr: each seed's loss at the end of its branch}}; a diverged run's loss is inf or nan."""


def sweep(lr: float, factor: float) -> tuple[float, ...]:
    """The lrs tried at a batch: the rule's lr divided and multiplied by ``factor`` once.

    >>> sweep(0.2, 2.0)
    (0.1, 0.2, 0.4)
    """
    return tuple(float(f"{x:.12g}") for x in (lr / factor, lr, lr * factor))


MOST_LRS = 6
"""At most this many lrs at one batch: the sweep's three, and up to three more past an edge its best lr sits on."""


def next_lr(by_lr: Mapping[float, Sequence[float]], factor: float, most: int = MOST_LRS) -> float | None:
    """The lr to add to a batch's sweep: one ``factor`` past the edge its best lr sits on (below the lowest when
    every run diverged); None when the best lr is interior or the batch already tried ``most`` lrs. A best on the
    edge is no best: nothing on that side lost to it.

    >>> next_lr({0.1: [2.0], 0.2: [1.5], 0.4: [1.2]}, 2.0), next_lr({0.1: [2.0], 0.2: [1.5], 0.4: [1.7]}, 2.0)
    (0.8, None)
    >>> next_lr({0.1: [1.0], 0.2: [1.5], 0.4: [float("inf")]}, 2.0), next_lr({0.1: [float("nan")]}, 2.0)
    (0.05, 0.05)
    """
    lrs = sorted(by_lr)
    if len(lrs) >= most:
        return None
    lr, _ = best(by_lr)
    if lr is None or (lr == lrs[0] and len(lrs) > 1):
        return float(f"{lrs[0] / factor:.12g}")
    if lr == lrs[-1] and len(lrs) > 1:
        return float(f"{lrs[-1] * factor:.12g}")
    return None


def seed_tolerance(seed_losses: Sequence[float]) -> float:
    """Half the range of the reference batch's seeds: a difference its own seeds show (0 with one seed).

    >>> seed_tolerance([1.0, 1.5, 1.2])
    0.25
    """
    finite = [x for x in seed_losses if math.isfinite(x)]
    return (max(finite) - min(finite)) / 2 if finite else 0.0


def lag_tolerance(loss_at_end: float, loss_earlier: float) -> float:
    """The tolerance that ``lag`` means: what the reference batch's loss fell over the budget's last fraction, so a
    batch matches when it is no further behind than that many samples (never below 0).

    >>> lag_tolerance(0.5, 0.8)
    0.30000000000000004
    """
    return max(loss_earlier - loss_at_end, 0.0)


def _clean(values: Sequence[float]) -> list[float]:
    # A diverged run (nan or inf) counts as the worst loss there is.
    return [x if math.isfinite(x) else math.inf for x in values]


Statistic = Literal["median", "worst", "best"]


def best(by_lr: Mapping[float, Sequence[float]], statistic: Statistic = "median") -> tuple[float | None, float]:
    """(lr, loss) of the lr with the lowest ``statistic`` of its seeds' end losses; (None, inf) when all diverged.

    >>> best({0.1: [3.0, 2.0, 4.0], 0.2: [2.5, 2.6, float("nan")]})
    (0.2, 2.6)
    >>> best({0.1: [3.0, 2.0, 4.0], 0.2: [2.5, 2.6, float("nan")]}, "worst")
    (0.1, 4.0)
    """
    pick = {"median": median, "worst": max, "best": min}[statistic]
    scored = sorted((pick(_clean(losses)), lr) for lr, losses in by_lr.items() if losses)
    if not scored or not math.isfinite(scored[0][0]):
        return None, math.inf
    return scored[0][1], scored[0][0]


@dataclasses.dataclass(frozen=True)
class Judgement:
    """The critical batch at one checkpoint, as judged from its branches' end losses."""

    critical_batch_size: int | None
    """None when the reference batch's own branches all diverged."""
    interval: tuple[int | None, int | None]
    reference_loss: float
    """The reference batch's best median end loss."""
    tolerance: float
    rows: list[dict]
    """Per batch: its best lr, median end loss, seeds' losses at that lr, and whether it matches."""

    @property
    def resolved(self) -> bool:
        """Whether the branches tell the critical batch apart from the grid's ends: not where it is unknown, nor where
        its seeds' interval spans every batch branched (any of them could be it)."""
        batches = [row["global_batch_size"] for row in self.rows]
        return self.critical_batch_size is not None and not (
            len(batches) > 1 and self.interval == (batches[0], batches[-1]))

    def unresolved_note(self, samples_seen: int) -> str | None:
        """What a checkpoint whose branches cannot tell its critical batch says instead of a schedule step."""
        if self.critical_batch_size is None or self.resolved:
            return None
        low, high = self.interval
        return (f"the branches cannot tell the critical batch at {samples_seen} samples: its seeds' interval "
                f"[{low}, {high}] spans every batch branched, so the schedule takes no step from it (more seeds, or "
                "longer branches, would tell)")

    @property
    def at_edge(self) -> bool:
        """The critical batch is the largest branched batch: it may lie above the grid."""
        return self.critical_batch_size is not None and self.critical_batch_size == self.rows[-1]["global_batch_size"]


def judge(losses: Losses, reference_global_batch: int, tolerance: float | None = None,
          paired: bool = False) -> Judgement:
    """The critical batch, its interval from the seeds and the tolerance used (see the module's docstring).

    ``paired``: judge each batch by its seeds' own deficits instead (:func:`paired_deficits`): a batch matches when the
    median over seeds of (its loss − the reference batch's on the same seed) is at most the tolerance, and the interval
    takes its worst and best seed's deficit.

    >>> losses = {8: {0.1: [1.00, 1.10, 1.20]}, 16: {0.2: [1.05, 1.12, 1.30]}, 32: {0.4: [1.20, 1.25, 1.40]},
    ...           64: {0.8: [1.25, 1.30, 1.50]}}
    >>> found = judge(losses, 8)
    >>> found.critical_batch_size, found.interval, round(found.tolerance, 3)
    (16, (8, 32), 0.1)
    >>> [row["matches"] for row in found.rows]
    [True, True, False, False]
    """
    batches = sorted(b for b in losses if b >= reference_global_batch)
    if not batches or batches[0] != reference_global_batch:
        raise UsageError(f"the branches need the reference global batch {reference_global_batch} itself "
                         "({reference_global_batch_size})")
    ref_lr, ref_loss = best(losses[reference_global_batch])
    if tolerance is None:
        tolerance = seed_tolerance(losses[reference_global_batch].get(ref_lr, [])) if ref_lr is not None else 0.0
    bound = ref_loss + tolerance
    ref_seeds = _clean(losses[reference_global_batch][ref_lr]) if ref_lr is not None else []
    rows = []
    for batch in batches:
        lr, loss = best(losses[batch])
        seeds = _clean(losses[batch][lr]) if lr is not None else []
        tried = sorted(losses[batch])
        row = {"global_batch_size": batch, "lr": lr, "median_loss": loss, "seed_losses": seeds,
               "matches": batch == reference_global_batch or loss <= bound, "lrs": tried,
               "lr_at_edge": lr is None or len(tried) > 1 and lr in (tried[0], tried[-1])}
        if paired:
            deficits = paired_deficits(seeds, ref_seeds) if lr is not None else [math.inf]
            row.update(paired_deficits=deficits, paired_deficit=median(deficits),
                       matches=batch == reference_global_batch or median(deficits) <= tolerance)
        rows.append(row)
    if not math.isfinite(ref_loss):
        return Judgement(None, (None, None), ref_loss, tolerance, rows)
    critical = _largest_matching(batches, [row["matches"] for row in rows])
    if paired:
        low, high = (_largest_matching(batches, [b == reference_global_batch or pick(row["paired_deficits"])
                                                 <= tolerance for b, row in zip(batches, rows)]) for pick in (max, min))
    else:
        low, high = (_largest_matching(batches, [b == reference_global_batch or best(losses[b], s)[1] <= bound
                                                 for b in batches]) for s in ("worst", "best"))
    return Judgement(critical, (low, high), ref_loss, tolerance, rows)


def paired_deficits(seed_losses: Sequence[float], reference_seed_losses: Sequence[float]) -> list[float]:
    """Each seed's end loss minus the reference batch's on the same seed. At one seed every batch trains on the very
    same samples, so the data's order, the largest part of the seeds' spread, cancels in the difference.

    >>> paired_deficits([2.10, 2.30, 2.05], [2.00, 2.25, 2.00])
    [0.1, 0.05, 0.05]
    """
    return [round(b - r, 12) if math.isfinite(b) and math.isfinite(r) else math.inf
            for b, r in zip(seed_losses, reference_seed_losses)]


def settled(judgement: Judgement) -> bool:
    """Whether larger batches than those judged can no longer change the critical batch or its interval: the
    largest one judged misses even with its best seed (the interval's high end lies below it), or the reference
    batch's own branches all diverged.

    >>> losses = {8: {0.1: [1.00, 1.10, 1.20]}, 16: {0.2: [1.05, 1.12, 1.30]}, 32: {0.4: [1.25, 1.30, 1.40]}}
    >>> settled(judge(losses, 8)), settled(judge({b: losses[b] for b in (8, 16)}, 8))
    (True, False)
    """
    if judgement.critical_batch_size is None:
        return True
    return judgement.interval[1] < judgement.rows[-1]["global_batch_size"]


def _largest_matching(batches: list[int], matches: list[bool]) -> int:
    """The largest batch up to which every batch matches (the first, the reference, always does)."""
    critical = batches[0]
    for batch, ok in zip(batches, matches):
        if not ok:
            break
        critical = batch
    return critical


@dataclasses.dataclass(frozen=True, kw_only=True)
class Judge:
    """How one checkpoint's branches are judged, from the batches trained so far (picklable: ranks call it too)."""

    groups: Groups
    reference: int
    samples: int
    tolerance: float | None
    lag_step: int | None
    paired: bool = False
    prior: Trained = dataclasses.field(default_factory=dict)
    """Batches trained before: what a later call adds is judged with them."""

    def __call__(self, trained: Trained) -> Judgement:
        trained = {**self.prior, **trained}
        losses = {batch: _by_lr(self.groups[batch][0], trained[batch][self.samples // batch]) for batch in trained}
        tolerance = self.tolerance
        if self.lag_step is not None:
            earlier = _by_lr(self.groups[self.reference][0], trained[self.reference][self.lag_step])
            lr, end = best(losses[self.reference])
            tolerance = lag_tolerance(end, median(earlier[lr])) if lr is not None else 0.0
        return judge(losses, self.reference, tolerance, self.paired)

    def settled(self, trained: Trained) -> bool:
        """No larger batch can change the judgement (:func:`settled`)."""
        return settled(self(trained))


def _by_lr(runs: list[tuple[float, int]], losses: list[float]) -> dict[float, list[float]]:
    out: dict[float, list[float]] = {}
    for (lr, _), loss in zip(runs, losses):
        out.setdefault(lr, []).append(loss)
    return out
