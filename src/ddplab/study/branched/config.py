"""How the critical batch from checkpoints is asked for: where to branch from, how the branches train and
how they are judged (torch-free: the command line reads its defaults).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

from ddplab.errors import UsageError
from ddplab.study.rules import registry
from ddplab.validation import at_least, one_of, positive, within, zero_or_more

LrRule = Literal["auto", "linear", "sqrt"]

STEPS_OF_LARGEST = 8
"""The default branch trains this many steps of its largest batch."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BranchConfig:
    """Where to branch from, and how the branches are trained and judged."""

    branch_at: tuple[float, ...] | None = None
    """Fractions of the reference run's steps to branch from, comma-separated (e.g. 0.1,0.3,0.6): the reference run
    (the reference global batch and lr, seed 0) trains to the target (or the step budget) first."""
    branch_from: tuple[str, ...] | None = None
    """Checkpoints of your run to branch from: torch.save'd dicts with model, optimizer and samples_seen (or step,
    counted in reference global batches), or what the spec's load(path, model, optimizer) reads."""
    branch_samples: int | None = None
    """Samples every branch trains (the same at every batch; a multiple of the largest branched batch; default 8
    steps of it, and under --branch-at never past the reference run's end: the grid is cut at each checkpoint to the
    batches whose 8 steps fit in what the run has left)."""
    branch_doublings: int = 5
    """How many times the branches double the reference global batch: × 1, 2, 4, … 2^this."""
    branch_lr_rule: LrRule = "auto"
    """How a branch's lr scales from the reference lr (then swept once down and once up by the sweep factor): linear,
    sqrt, or auto (linear for SGD, sqrt for Adam and AdamW)."""
    branch_tolerance: float | None = None
    """How much higher than the reference batch's a batch's end loss may be and still match, in loss units
    (default: half the range of the reference batch's seeds)."""
    branch_lag: float | None = None
    """Instead of a tolerance in loss: a batch matches when its end loss is no worse than where the reference batch
    was this fraction of the budget earlier (0.5: half the samples behind, McCandlish et al.'s B_crit)."""
    branch_paired: bool = False
    """Judge each batch by its seeds' own deficits: the median over seeds of its end loss minus the reference batch's
    on the same seed (the same samples), against the tolerance; the seeds' order of the data cancels in it."""
    branch_every_batch: bool = False
    """Train every batch of the grid. By default the doubling stops at the first batch that misses with every seed:
    no larger batch can change the critical batch or its interval, so their branches would only cost samples."""

    def __post_init__(self):
        if (self.branch_at is None) == (self.branch_from is None):
            raise UsageError("give one of {branch_at} and {branch_from}")
        if self.branch_at is not None:
            if not self.branch_at or not all(0 <= f < 1 for f in self.branch_at):
                raise UsageError(f"{{branch_at}} must be fractions in [0, 1), got {self.branch_at}")
            object.__setattr__(self, "branch_at", tuple(sorted(set(self.branch_at))))
        if self.branch_from is not None:
            if not self.branch_from:
                raise UsageError("{branch_from} needs at least one checkpoint file")
            object.__setattr__(self, "branch_from", tuple(self.branch_from))
        positive("branch_samples", self.branch_samples, integer=True)
        at_least("branch_doublings", self.branch_doublings)
        one_of("branch_lr_rule", self.branch_lr_rule, get_args(LrRule))
        zero_or_more("branch_tolerance", self.branch_tolerance)
        if self.branch_lag is not None:
            within("branch_lag", self.branch_lag, "(0, 1)")
        if self.branch_tolerance is not None and self.branch_lag is not None:
            raise UsageError("give {branch_tolerance} or {branch_lag}, not both")

    def global_batch_sizes(self, reference_global_batch_size: int) -> tuple[int, ...]:
        """The branches' batches: B_ref·2^i for i = 0 … ``branch_doublings``."""
        return tuple(reference_global_batch_size << i for i in range(self.branch_doublings + 1))

    def samples(self, reference_global_batch_size: int) -> int:
        """Samples per branch: ``branch_samples``, else 8 steps of the largest batch; a multiple of it."""
        largest = self.global_batch_sizes(reference_global_batch_size)[-1]
        samples = self.branch_samples or STEPS_OF_LARGEST * largest
        if samples % largest:
            raise UsageError(f"{{branch_samples}} {samples} must be a multiple of the largest branched global batch "
                             f"{largest}, so that every batch trains on the same samples")
        return samples

    def ladder(self, reference_global_batch_size: int, remaining: int | None) -> tuple[tuple[int, ...], int]:
        """The batches branched from one checkpoint and the samples each trains. ``branch_samples`` where given, and
        where nothing says what remains of the run (``remaining`` None: your own checkpoints), the whole grid at
        :meth:`samples`. Else 8 steps of the largest batch, the grid cut at the largest batch whose 8 steps fit in
        ``remaining`` (the reference run's samples after the checkpoint, at least two batches): a branch past the
        run's end would judge a batch over training the run does not have, where the larger batch catches up.

        >>> config = BranchConfig(branch_at=(0.5,), branch_doublings=3)
        >>> config.ladder(32, None), config.ladder(32, 2000), config.ladder(32, 100)
        (((32, 64, 128, 256), 2048), ((32, 64, 128), 1024), ((32, 64), 512))
        """
        batches = self.global_batch_sizes(reference_global_batch_size)
        if self.branch_samples is not None or remaining is None:
            return batches, self.samples(reference_global_batch_size)
        kept = tuple(b for b in batches if STEPS_OF_LARGEST * b <= remaining) or batches[:1]
        kept = kept if len(kept) > 1 else batches[:2]
        return kept, STEPS_OF_LARGEST * kept[-1]

    def lr_rule(self, adam: bool) -> Literal["linear", "sqrt"]:
        """The lr rule in force: auto is sqrt for Adam and AdamW, linear for SGD."""
        if self.branch_lr_rule == "auto":
            return "sqrt" if adam else "linear"
        return self.branch_lr_rule


def scaled_lr(reference_lr: float, global_batch: int, reference_global_batch: int, rule: str) -> float:
    """The rule's lr at ``global_batch``.

    >>> scaled_lr(0.1, 128, 32, "linear"), scaled_lr(0.1, 128, 32, "sqrt")
    (0.4, 0.2)
    """
    return reference_lr * registry.get(rule).factor(global_batch / reference_global_batch)
