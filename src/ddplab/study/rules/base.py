"""What a study rule is: how it sets a run's lr, optimizer and batch, which runs it trains, and how it is read.

A rule is one object (one module under ``ddplab.study.rules``); the grid, the engines and the analysis ask it,
and nothing else looks at its name.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar, NamedTuple

from ddplab.study.runs import LrScaling, RunGroup, RunResult

if TYPE_CHECKING:
    from ddplab.study.config import OptimizerConfig, StudyConfig


def round_lr(lr: float) -> float:
    # Twelve significant digits: the same lr reached by two rules is one run.
    return float(f"{lr:.12g}")


class Best(NamedTuple):
    """The tuned sweep's best setting at one batch."""

    lr: float
    median_steps: float
    variant: str = ""
    """"" for the study's optimizer, else the rule whose Adam settings the best runs stepped with."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchRuns:
    """Every run trained at one global batch, as the analysis reads them."""

    config: StudyConfig
    global_batch_size: int
    lrs: dict[float, list[str]]
    """Each fixed lr trained here with the study's optimizer and the rules it serves."""
    fixed: dict[tuple[float, int, str], RunResult]
    """The shared grid's runs by (lr, seed, variant)."""
    own: dict[str, dict[int, RunResult]]
    """The runs of each rule with a group of its own, by seed."""
    best: Best | None
    """The tuned sweep's best setting; None without a sweep or when no median arrived."""
    variants: tuple[str, ...] = ()
    """The rules whose Adam settings the tuned sweep also trained here, each at every lr of the sweep."""

    def seeds_at(self, lr: float, variant: str = "") -> list[RunResult]:
        return [self.fixed[(lr, seed, variant)] for seed in range(self.config.seeds)]


class Rule:
    """A way to train at a global batch from the reference (batch, lr). Subclasses set the class attributes and
    override what differs."""

    name: ClassVar[str]
    summary: ClassVar[str]
    """One line for the docs."""
    help: ClassVar[str] = ""
    """Its clause in --rules' help, after the defaults (``field`` names shown as their flags); "" for none."""
    colour: ClassVar[str | None] = None
    """Its colour in every figure (None: a spare one, the same in every figure)."""
    default_for: ClassVar[tuple[str, ...]] = ()
    """The optimizer families whose studies run it when no rules are given."""
    predicts: ClassVar[tuple[str, ...]] = ()
    """The optimizer families whose best lr it is the textbook prediction of (the lr figures draw it)."""
    shares_grid: ClassVar[bool] = False
    """Its runs are fixed lrs of the grid the fixed-lr rules share (one run may serve several rules)."""
    sweeps: ClassVar[bool] = False
    """Its lrs are a sweep whose best run is the ground truth the others are judged against (tuned)."""
    lr_scaling: ClassVar[LrScaling] = "fixed"
    fitted: ClassVar[bool] = True
    """Steps-to-target is fitted against the batch for it; a rule whose batch changes is judged otherwise."""
    adam_only: ClassVar[bool] = False
    """It sets Adam's betas or eps, so it needs an Adam-family optimizer."""
    multi_rank: ClassVar[bool] = False
    """On the DDP engine it measures across ranks, so it needs two or more."""
    single_process: ClassVar[bool] = False
    """It trains one model in this process (not under torchrun)."""
    batch_changes: ClassVar[bool] = False
    """Its runs change their global batch as they train: the engine for such runs trains its groups."""

    def check(self, config: StudyConfig) -> None:
        """Raise UsageError when the study's settings cannot run this rule."""

    def measures_at_reference(self, config: StudyConfig) -> str | None:
        """What it measures at the reference batch, which the study then trains even where ``global_batch_sizes``
        leaves it out; None where it needs nothing there."""
        return None

    # The grid.
    def grid_lrs(self, config: StudyConfig, global_batch: int) -> list[float]:
        """The lrs this rule trains at ``global_batch`` in the grid the fixed-lr rules share."""
        return []

    def optimizer(self, config: StudyConfig, global_batch: int) -> OptimizerConfig:
        """The optimizer its runs step with at ``global_batch``."""
        return config.optimizer

    def variant(self, config: StudyConfig, global_batch: int) -> OptimizerConfig | None:
        """Settings of its own the tuned sweep must try at ``global_batch`` (Adam's betas, eps, weight decay scaled
        with the batch), each lr of the sweep trained with them too: so a rule can only beat the ground truth by
        its lr falling between the sweep's. None where it keeps the study's optimizer."""
        return None

    def group(self, config: StudyConfig, global_batch: int, trained: dict[int, list[RunResult]]) -> RunGroup | None:
        """Its group of its own at ``global_batch``, or None; ``trained`` holds the shared grid's runs at every batch
        (and the rules' own groups trained before)."""
        return None

    def stretches(self, config: StudyConfig) -> int:
        """Stretches of ``max_steps`` its own groups train (for progress)."""
        return 0

    # The analysis.
    def seeds_at(self, view: BatchRuns) -> list[RunResult] | None:
        """The runs, one per seed, this rule is judged by at the view's batch; None where it has none."""
        return None

    def lr_at(self, view: BatchRuns) -> float | None:
        """The lr it trains at the view's batch (the scorecard's lr gap); None where it has no runs there or its lr
        changes as it trains."""
        runs = self.seeds_at(view)
        return runs[0].lr if runs and self.fitted and self.lr_scaling == "fixed" else None

    def rows(self, view: BatchRuns) -> list[dict]:
        """Its runs at the view's batch in its own groups, as the runs table lists them."""
        return [row(self.name, view.global_batch_size, run) for run in self.seeds_at(view) or []]

    def serves(self, run: RunResult, lrs: dict[float, list[str]]) -> bool:
        """Whether ``run`` is one of this rule's."""
        return run.rule == self.name

    def report(self, config: StudyConfig, batches: dict[int, BatchRuns], tuned: list[dict]) -> dict:
        """Sections of its own in the study's JSON ({key: value})."""
        return {}

    def warnings(self, config: StudyConfig, batches: dict[int, BatchRuns]) -> list[str]:
        return []

    # What the study says of it, read from the study's JSON (``values``).
    def lr_text(self, values: dict) -> list[str]:
        """Its sentences on the lrs it trains, printed under the scorecard."""
        return []

    def text(self, values: dict) -> list[str]:
        """Its sentences on how it did, printed after the lrs."""
        return []

    def html(self, values: dict) -> str:
        """Its section of report.html ("" for none)."""
        return ""

    def figures(self, values: dict, directory: str, drawing) -> list[str]:
        """Figures of its own under ``directory``, their paths; ``drawing`` is :mod:`ddplab.study.report.figures`
        (its pyplot, colours and axes), handed in as the rules sit below the report."""
        return []


class GridRule(Rule):
    """A fixed lr at each batch (the reference lr × a factor of k = B/B_ref), in the shared grid."""

    shares_grid = True

    def factor(self, k: float) -> float:
        raise NotImplementedError

    def lr(self, config: StudyConfig, global_batch: int) -> float:
        return round_lr(config.scale_lr * self.factor(global_batch / config.reference_global_batch_size))

    def grid_lrs(self, config: StudyConfig, global_batch: int) -> list[float]:
        return [self.lr(config, global_batch)]

    def seeds_at(self, view: BatchRuns) -> list[RunResult] | None:
        return view.seeds_at(self.lr(view.config, view.global_batch_size))

    def rows(self, view: BatchRuns) -> list[dict]:
        # The shared grid's rows are listed lr by lr (analysis.grid_rows), every rule an lr serves beside it.
        return []

    def serves(self, run: RunResult, lrs: dict[float, list[str]]) -> bool:
        return not run.rule and not run.variant and self.name in lrs.get(run.lr, [])


class OwnGroupRule(Rule):
    """Runs of its own at every batch it trains at, one per seed, cached apart from the grid."""

    def runs(self, config: StudyConfig, global_batch: int) -> list[tuple[float, int]]:
        raise NotImplementedError

    def group(self, config: StudyConfig, global_batch: int, trained: dict[int, list[RunResult]]) -> RunGroup | None:
        runs = self.runs(config, global_batch)
        if not runs:
            return None
        return RunGroup(global_batch_size=global_batch, runs=tuple(runs), rule=self.name,
                        optimizer=self.optimizer(config, global_batch), lr_scaling=self.lr_scaling)

    def stretches(self, config: StudyConfig) -> int:
        return sum(bool(self.runs(config, b)) for b in config.global_batch_sizes)

    def seeds_at(self, view: BatchRuns) -> list[RunResult] | None:
        own = view.own.get(self.name, {})
        if 0 not in own:
            return None
        return [own[seed] for seed in range(view.config.seeds)]



def row(rule: str, global_batch: int, run: RunResult, *, best: bool = False, **extra) -> dict:
    """One run as the runs table lists it (a run serving several rules is listed once per rule)."""
    return {"rule": rule, "global_batch_size": global_batch, "lr": run.lr, "seed": run.seed, "variant": run.variant,
            "optimizer": run.optimizer,
            "steps_to_target": run.steps_to_target, "samples_to_target": samples(run, global_batch),
            "diverged": run.diverged, "stalled": run.stalled, "pruned": run.pruned, "extension": run.extension,
            "failed": run.failed, "best": best, **extra}


def html_num(value: float | None) -> str:
    """A number as report.html shows it: four figures, or a dash where there is none."""
    return "—" if value is None else f"{value:.4g}"


def samples(run: RunResult, global_batch: int) -> int | None:
    """Samples to the target: what the run counted (a ramp's batch changes), else steps × its fixed batch."""
    if run.samples_to_target is not None or run.steps_to_target is None:
        return run.samples_to_target
    return run.steps_to_target * global_batch
