"""What a study trains and what each run found: run groups, run results, and when a run is finished.

Torch-free: the engines fill these in, the rules and the analysis read them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Literal

from ddplab.noise import estimators
from ddplab.study import fit

if TYPE_CHECKING:
    from ddplab.study.config import OptimizerConfig, StudyConfig

DIVERGED_LOSS = 1e6
"""A run whose training loss is not finite, or explodes past this, has diverged."""

LrScaling = Literal["fixed", "gain"]
"""How a group's runs set each update's lr: their own lr throughout, or that lr times AdaScale's measured gain."""


RunKey = tuple[float, int, str]
"""(lr, seed, variant) of one run of a group: its identity in the cache."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunGroup:
    """Runs trained together: one global batch, one way of setting the lr, one optimizer family."""

    global_batch_size: int
    runs: tuple[tuple[float, int], ...]
    """(lr, seed) of each run."""
    optimizer: OptimizerConfig
    """The optimizer the group's runs step with (its lr is the run's), where ``optimizers`` does not say otherwise."""
    variants: tuple[str, ...] = ()
    """Each run's variant, in the order of ``runs`` (empty: every run's is ""): "" steps with ``optimizer``; a
    rule's name, with that rule's Adam settings at this batch (the tuned sweep trains every lr with each)."""
    optimizers: tuple[OptimizerConfig, ...] = ()
    """Each run's optimizer, in the order of ``runs``, where the runs differ (empty: every run's is ``optimizer``)."""
    rule: str = ""
    """The rule whose group of its own this is; "" for the grid of fixed lrs that several rules share."""
    lr_scaling: LrScaling = "fixed"
    sweep_only: frozenset[tuple[float, str]] = frozenset()
    """(lr, variant) of the runs that serve the tuned sweep alone: they stop once they can no longer be the best."""
    extension: bool = False
    """Sweep lrs past the configured sweep's edge, added because the best lr sat on it."""
    cache_tag: str = ""
    """Settings of its rule's own that its runs depend on beyond the study's (a schedule's digest): cached apart."""

    def __post_init__(self):
        for name in ("variants", "optimizers"):
            if getattr(self, name) and len(getattr(self, name)) != len(self.runs):
                raise ValueError(f"RunGroup.{name} must hold one entry per run")

    @property
    def cache_key(self) -> str:
        """The suffix of the group's cache file beside its batch size."""
        return f"-{self.rule}{self.cache_tag}" if self.rule else "-extension" if self.extension else ""

    def run_variants(self) -> list[str]:
        return list(self.variants) or [""] * len(self.runs)

    def run_optimizers(self) -> list[OptimizerConfig]:
        """Each run's optimizer."""
        return list(self.optimizers) or [self.optimizer] * len(self.runs)

    def keys(self) -> list[RunKey]:
        """Each run's (lr, seed, variant)."""
        return [(lr, seed, variant) for (lr, seed), variant in zip(self.runs, self.run_variants())]

    def results(self) -> list[RunResult]:
        """A fresh result per run, for an engine to fill in."""
        return [RunResult(global_batch_size=self.global_batch_size, lr=lr, seed=seed, rule=self.rule,
                          extension=self.extension, variant=variant, optimizer=settings(optimizer))
                for (lr, seed, variant), optimizer in zip(self.keys(), self.run_optimizers())]

    def only(self, keys: set[RunKey]) -> RunGroup:
        """The runs whose (lr, seed, variant) is in ``keys``, as a group of their own (the rest read back)."""
        kept = [i for i, key in enumerate(self.keys()) if key in keys]
        return dataclasses.replace(self, runs=tuple(self.runs[i] for i in kept),
                                   variants=tuple(self.variants[i] for i in kept) if self.variants else (),
                                   optimizers=tuple(self.optimizers[i] for i in kept) if self.optimizers else ())

    def part(self, start: int, stop: int) -> RunGroup:
        """The runs ``start`` to ``stop`` as a group of their own (a group split to fit in memory)."""
        return dataclasses.replace(self, runs=self.runs[start:stop], variants=self.variants[start:stop],
                                   optimizers=self.optimizers[start:stop])


def settings(optimizer: OptimizerConfig) -> dict | None:
    """The Adam settings a run stepped with (betas, eps, weight decay), as its result records them; None for SGD
    (the rules scale no SGD setting)."""
    if not optimizer.adam:
        return None
    return {"betas": list(optimizer.betas), "eps": optimizer.eps, "weight_decay": optimizer.weight_decay}


@dataclasses.dataclass
class RunResult:
    """One (batch, lr, seed) run."""

    global_batch_size: int
    lr: float
    seed: int
    rule: str = ""
    """The rule that trained it in a group of its own (adascale, adam-sqrt, ramp); "" for the shared fixed grid."""
    steps_to_target: int | None = None
    diverged: bool = False
    pruned: bool = False
    """Stopped early: a tuned-sweep lr that can no longer be the best at its batch size."""
    history: list = dataclasses.field(default_factory=list)
    """[step, training loss, metric] at each evaluation."""
    noise_g2: list = dataclasses.field(default_factory=list)
    noise_trace: list = dataclasses.field(default_factory=list)
    """Per-evaluation |G|² and tr Σ (estimators.unbiased_estimates) up to the target."""
    gains: list = dataclasses.field(default_factory=list)
    """AdaScale runs: [step, gain, τ] at each evaluation (the gain of that step's update)."""
    trajectory: list = dataclasses.field(default_factory=list)
    """Runs whose batch changes (the ramp): [step, global batch, lr] at each evaluation."""
    samples_to_target: int | None = None
    """Training samples consumed until the target was reached."""
    stalled: bool = False
    """Stopped early: no better metric for ``StudyConfig.patience`` evaluations."""
    extension: bool = False
    """A tuned-sweep lr past the configured sweep's edge, added because the best lr sat on it."""
    variant: str = ""
    """"" for the study's optimizer; a rule's name for a tuned-sweep run with that rule's Adam settings."""
    optimizer: dict | None = None
    """The Adam settings it stepped with (betas, eps, weight_decay); None for SGD or a run cached before."""
    failed: str | None = None
    """Why the run could not be trained (its command failed twice): it counts as not reached."""

    @property
    def key(self) -> RunKey:
        return self.lr, self.seed, self.variant

    @property
    def fixed(self) -> bool:
        """Trained at a fixed lr and batch with the study's optimizer, in the grid the fixed-lr rules share."""
        return not self.rule

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, row: dict) -> RunResult:
        """A run as the cache holds it (a cache written before groups named their rule flags it instead)."""
        row = dict(row)
        for flag, rule in (("adascale", "adascale"), ("ramp", "ramp"), ("adam_sqrt", "adam-sqrt")):
            if row.pop(flag, False):
                row["rule"] = rule
        return cls(**row)


def settle(config: StudyConfig, result: RunResult, steps: int, metric: float) -> bool:
    """Record an evaluation's ``metric`` after ``steps``; True when it finishes the run: diverged, reached the target
    or stalled (the one decision both engines and the ramp take)."""
    if not math.isfinite(metric):
        result.diverged = True
    elif config.target.reached(metric):
        result.steps_to_target = steps
    elif stalled(config, result.history):
        result.stalled = True
    else:
        return False
    return True


def stalled(config: StudyConfig, history: list) -> bool:
    """No evaluation among the last ``patience`` improved on the best before them."""
    patience = config.patience
    if not patience or len(history) <= patience:
        return False
    sign = _better(config)
    before = max(sign * h[2] for h in history[:-patience])
    return max(sign * h[2] for h in history[-patience:]) <= before


def longest_plateau(config: StudyConfig, history: list) -> int:
    """The most evaluations in a row that did not improve on the best metric before them (the stall rule stops a
    run once its last plateau reaches ``patience``)."""
    sign = _better(config)
    best, run, longest = -math.inf, 0, 0
    for row in history:
        if sign * row[2] > best:
            best, run = sign * row[2], 0
        else:
            run += 1
            longest = max(longest, run)
    return longest


def _better(config: StudyConfig) -> float:
    """+1 where a higher metric is better (accuracy), -1 where a lower one is (loss)."""
    return 1.0 if config.target.kind == "accuracy" else -1.0


def settled_best(results) -> tuple[tuple[float, str] | None, float]:
    """((lr, variant), median steps) of the fewest median steps among the settings whose median is settled: n//2 + 1
    of its n seeds reached the target, and the rest can only be slower (still running behind them, or never
    arriving). (None, inf) when no median is settled."""
    by_lr: dict[tuple[float, str], list[RunResult]] = {}
    for result in results:
        by_lr.setdefault((result.lr, result.variant), []).append(result)
    best_lr, best = None, math.inf
    for lr, runs in by_lr.items():
        reached = sorted(r.steps_to_target for r in runs if r.steps_to_target is not None)
        if len(reached) >= len(runs) // 2 + 1:
            median = fit.median(reached + [math.inf] * (len(runs) - len(reached)))
            if median < best:
                best_lr, best = lr, median
    return best_lr, best


def loser_bound(best: float, seeds: int) -> float:
    """Steps past which a run of another lr can no longer have the fewest median steps."""
    # With an even seed count the median averages two runs: a loser is certain only past twice the best.
    return best * (2 if seeds % 2 == 0 else 1)


def prune_bound(config: StudyConfig, finished: list[RunResult], setting: tuple[float, str]) -> float:
    """Steps past which a run of ``setting`` (lr, variant) can no longer be its batch's best, given the runs
    ``finished`` before it starts (inf where no other setting's median is settled)."""
    by_lr: dict[tuple[float, str], list[RunResult]] = {}
    for result in finished:
        by_lr.setdefault((result.lr, result.variant), []).append(result)
    # Only an lr whose seeds have all finished is settled.
    complete = [r for runs in by_lr.values() if len(runs) == config.seeds for r in runs]
    best_lr, best = settled_best(complete)
    return math.inf if best_lr is None or best_lr == setting else loser_bound(best, config.seeds)


def steps(run: RunResult) -> float:
    """Steps to the target, inf for a run that never arrived."""
    return float(run.steps_to_target) if run.steps_to_target is not None else math.inf


def grid_group(config: StudyConfig, global_batch: int, runs, variants: dict[str, OptimizerConfig] | None = None,
               **fields) -> RunGroup:
    """A group of the shared grid at ``global_batch``: ``runs`` (lr, seed) with the study's optimizer, or (lr, seed,
    variant) with ``variants[variant]`` where the variant is not ""."""
    keys = [(run[0], run[1], run[2] if len(run) > 2 else "") for run in runs]
    pairs = tuple((lr, seed) for lr, seed, _ in keys)
    if not any(variant for _, _, variant in keys):
        return RunGroup(global_batch_size=global_batch, runs=pairs, optimizer=config.optimizer, **fields)
    optimizers = tuple(variants[v] if v else config.optimizer for _, _, v in keys)
    return RunGroup(global_batch_size=global_batch, runs=pairs, optimizer=config.optimizer,
                    variants=tuple(v for _, _, v in keys), optimizers=optimizers, **fields)


def b_simple_summary(runs: list[RunResult], stage: int | None = None) -> dict | None:
    """B_simple of the runs' measurements (of the stage-th third of each run's, when given), with its interval and
    the training steps it was measured between."""
    g2s, traces, steps_measured = [], [], []
    for run in runs:
        n = len(run.noise_g2)
        part = slice(None) if stage is None else slice(stage * n // 3, (stage + 1) * n // 3)
        g2s += run.noise_g2[part]
        traces += run.noise_trace[part]
        # One measurement per evaluation: the history's steps say when each was taken.
        if len(run.history) == n:
            steps_measured += [h[0] for h in run.history[part]]
    if len(g2s) < 2:
        return None
    summary = estimators.summarize(g2s, traces)
    interval = list(summary.b_simple_ci95) if summary.b_simple_ci95 is not None else [None, None]
    span = [min(steps_measured), max(steps_measured)] if steps_measured else None
    return {"value": summary.b_simple, "ci95": interval, "measurements": summary.steps, "steps": span}
