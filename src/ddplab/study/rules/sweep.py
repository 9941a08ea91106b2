"""The grid as the rules read it: the lrs each batch trains and the rules they serve, the tuned sweep's points and
its best, and one batch's runs as a :class:`~ddplab.study.rules.base.BatchRuns` view."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ddplab.study import fit
from ddplab.study.rules.base import BatchRuns, Best
from ddplab.study.rules.registry import of, sweeping
from ddplab.study.runs import RunResult, b_simple_summary, steps

if TYPE_CHECKING:
    from ddplab.study.config import OptimizerConfig, StudyConfig


def lrs(config: StudyConfig, global_batch: int) -> dict[float, list[str]]:
    """Every lr the shared grid trains at ``global_batch`` and the rules it serves (one run serves several)."""
    out: dict[float, list[str]] = {}
    for rule in of(config):
        for lr in rule.grid_lrs(config, global_batch):
            out.setdefault(lr, []).append(rule.name)
    return out


def variants(config: StudyConfig, global_batch: int) -> dict[str, OptimizerConfig]:
    """The optimizers the tuned sweep trains at ``global_batch`` beside the study's, by the rule they come from:
    each rule's :meth:`~Rule.variant`, once per distinct setting (none without a sweep)."""
    if sweeping(config) is None:
        return {}
    out: dict[str, OptimizerConfig] = {}
    for rule in of(config):
        optimizer = rule.variant(config, global_batch)
        if optimizer is not None and optimizer != config.optimizer and optimizer not in out.values():
            out[rule.name] = optimizer
    return out


def sweep_points(config: StudyConfig, global_batch: int, swept: list[float]) -> list[tuple[float, str]]:
    """(lr, variant) of every setting the sweep trains at its lrs ``swept``: each lr with the study's optimizer
    ("") and with each variant."""
    names = ["", *variants(config, global_batch)]
    return [(lr, variant) for lr in swept for variant in names]


def grid_runs(config: StudyConfig, global_batch: int) -> list[tuple[float, int, str]]:
    """Every (lr, seed, variant) of the shared grid at ``global_batch``."""
    sweep = sweeping(config)
    swept = [lr for lr, names in lrs(config, global_batch).items() if sweep and sweep.name in names]
    extra = [point for point in sweep_points(config, global_batch, swept) if point[1]]
    return [(lr, seed, "") for lr in lrs(config, global_batch) for seed in range(config.seeds)] + \
        [(lr, seed, variant) for lr, variant in extra for seed in range(config.seeds)]


def sweep_only(config: StudyConfig, global_batch: int) -> frozenset[tuple[float, str]]:
    """The grid's (lr, variant) that serve the sweep alone: their runs may stop once they cannot be the best."""
    sweep = sweeping(config)
    if sweep is None:
        return frozenset()
    alone = [lr for lr, names in lrs(config, global_batch).items() if names == [sweep.name]]
    swept = [lr for lr, names in lrs(config, global_batch).items() if sweep.name in names]
    return frozenset([(lr, "") for lr in alone] +
                     [point for point in sweep_points(config, global_batch, swept) if point[1]])


def sweep_lrs(config: StudyConfig, global_batch: int, runs: list[RunResult]) -> dict[float, list[str]]:
    """Every fixed lr trained at ``global_batch`` and the rules it serves: the grid's, and the sweep's extensions
    past its edge."""
    out = {lr: list(names) for lr, names in lrs(config, global_batch).items()}
    sweep = sweeping(config)
    for run in runs:
        # An extension's lr may also be a rule's (the rules scale from the sweep's best, which may be one).
        if run.extension and sweep is not None and sweep.name not in out.setdefault(run.lr, []):
            out[run.lr].append(sweep.name)
    return out


def tuned_best(config: StudyConfig, global_batch: int, runs: list[RunResult]) -> Best | None:
    """The sweep's best (lr, variant) at ``global_batch`` among ``runs``, with its median steps; None without a
    sweep or when no median arrived."""
    sweep = sweeping(config)
    if sweep is None:
        return None
    fixed = {r.key: r for r in runs if r.fixed}
    swept = [lr for lr, names in sweep_lrs(config, global_batch, runs).items() if sweep.name in names]
    points = {(lr, variant): [fixed.get((lr, s, variant)) for s in range(config.seeds)]
              for lr, variant in sweep_points(config, global_batch, swept)}
    # A setting whose runs are not all here (a cache from before the variants) is no candidate.
    best = fit.best_lr({point: [steps(r) for r in found] for point, found in points.items() if None not in found})
    return Best(lr=best[0][0], median_steps=best[1], variant=best[0][1]) if best else None


def anchored(config: StudyConfig, trained: dict[int, list[RunResult]]) -> StudyConfig:
    """``config`` with ``rules_lr`` the tuned sweep's best lr at the reference batch, where it is not set and that
    batch's runs are in ``trained`` (the rules scale from what the study found best there); else ``config``."""
    reference = config.reference_global_batch_size
    if config.rules_lr is not None or reference not in trained:
        return config
    best = tuned_best(config, reference, trained[reference])
    return config if best is None else dataclasses.replace(config, rules_lr=best.lr)


def rules_lr(config: StudyConfig, trained: dict[int, list[RunResult]]) -> dict:
    """The lr the rules scaled from and where it came from: ``given`` (``rules_lr``), ``best_at_reference`` (the
    sweep's best at the reference batch) or ``reference_lr`` (no sweep there, or none of its medians arrived)."""
    if config.rules_lr is not None:
        return {"lr": config.rules_lr, "source": "given"}
    found = anchored(config, trained).rules_lr
    if found is None:
        return {"lr": config.reference_lr, "source": "reference_lr"}
    return {"lr": found, "source": "best_at_reference"}


def view(config: StudyConfig, global_batch: int, runs: list[RunResult]) -> BatchRuns:
    """The runs of one batch as the rules read them."""
    own: dict[str, dict[int, RunResult]] = {}
    for run in runs:
        if run.rule:
            own.setdefault(run.rule, {})[run.seed] = run
    return BatchRuns(config=config, global_batch_size=global_batch, lrs=sweep_lrs(config, global_batch, runs),
                     fixed={r.key: r for r in runs if r.fixed}, own=own,
                     best=tuned_best(config, global_batch, runs),
                     variants=tuple(variants(config, global_batch)))


def b_simple_at(config: StudyConfig, global_batch: int, runs: list[RunResult]) -> float | None:
    """B_simple along the best tuned runs at one batch (its seeds that reached the target), as ``b_simple``'s
    ``by_batch`` gives it: what the surge rule takes for B_noise at the reference batch. None where not measured."""
    best = tuned_best(config, global_batch, runs)
    if best is None:
        return None
    fixed = {r.key: r for r in runs if r.fixed}
    arrived = [fixed[(best.lr, seed, best.variant)] for seed in range(config.seeds)]
    summary = b_simple_summary([r for r in arrived if r.steps_to_target is not None])
    return summary["value"] if summary else None
